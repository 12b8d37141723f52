"""Exceptions of the store: what a reader or an SQL sink raises when a store cannot be used."""

from __future__ import annotations

from batchtap.errors import SinkError

__all__ = ["StoreError", "RunNotFound", "MetricNotFound"]


class StoreError(SinkError):
    """A store cannot be opened, created or read: not a batchtap store, a newer schema version,
    an unreachable server, an unwritable path.

    It subclasses :class:`~batchtap.errors.SinkError` so that code around a sink's constructor
    (``except SinkError``) also catches it.
    """


class RunNotFound(StoreError, LookupError):
    """No run matches the id, id prefix or name given to :meth:`batchtap.store.Store.run`.

    Attributes:
        ref: what was asked for.
        candidates: the closest known run names or ids, best first (may be empty).
    """

    def __init__(self, message: str, *, ref: str, candidates: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.ref = ref
        self.candidates = candidates


class MetricNotFound(StoreError, LookupError):
    """A run has no metric of the name given to a reader method (:meth:`batchtap.store.Store.series`, ...).

    Attributes:
        ref: the name asked for.
        candidates: the closest names the run has, best first (may be empty).
    """

    def __init__(self, message: str, *, ref: str, candidates: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.ref = ref
        self.candidates = candidates
