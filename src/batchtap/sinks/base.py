"""The sink interface: where decoded records go.

A sink runs on batchtap's dispatcher thread, never on the training thread, and sees host values
only. The contract is deliberately small:

* ``write(records, events)`` — a block of records in step order, plus the events raised while
  decoding them. Called once per flushed block.
* ``flush()`` — make everything written so far durable/visible.
* ``close()`` — release files and connections.
* ``start_run(run)`` / ``end_run(run)`` — run life-cycle hooks; the defaults do nothing.
* ``start_epoch(run_id, epoch, total)`` — ``Tap.watch()`` began an epoch of ``total`` batches
  (None: the loader has no length); for progress displays; the default does nothing.

Optional third-party packages a sink needs are imported inside the sink's constructor, with an error
naming the extra to install (see :func:`require`).

A sink is pickled into the pipeline process under ``bt.Tap(pipeline="process")``: what it holds of
this process only (connections, open files, threads, locks, servers) must not travel. The built-in
sinks name those attributes in :attr:`Sink._live`; pickling leaves them out, and unpickling opens
them again through :meth:`Sink._open_live`, as the constructor did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from batchtap.errors import SinkError
from batchtap.records import Event, EventKind, Record, RunInfo

from batchtap._optional import require  # re-exported: sinks import it from here

#: Counter names under which sinks of other trackers (MLflow, W&B) count a run's events by kind.
EVENT_COUNTERS = {
    EventKind.ANOMALY: "batchtap/anomalies",
    EventKind.ACTION: "batchtap/actions",
    EventKind.SKIP: "batchtap/skipped_steps",
    EventKind.WARNING: "batchtap/warnings",
}

__all__ = ["Sink", "SinkDataError", "EVENT_COUNTERS", "require"]


class SinkDataError(SinkError):
    """A block cannot be stored because of what it holds (a value or name the store refuses),
    not because the store is unavailable: writing it again later fails the same way.

    :class:`batchtap.pipeline.resilient.ResilientSink` therefore never spools such a block
    behind the others: it reports it and, for a spooled block, sets it aside in a quarantine
    file after a bounded number of tries.
    """


class Sink:
    """Base class of every sink. Subclasses implement :meth:`write`; the rest is optional.

    Example:
        >>> class Count(Sink):
        ...     def __init__(self) -> None:
        ...         self.n = 0
        ...     def write(self, records, events=()):
        ...         self.n += len(records)
        >>> Count().n
        0
    """

    #: Attributes holding what only this process can use (connections, open files, threads,
    #: locks, servers): pickling leaves them out, and the unpickled copy has them None until
    #: :meth:`_open_live` opens its own.
    _live: ClassVar[tuple[str, ...]] = ()

    def __getstate__(self) -> dict[str, Any]:
        """What pickling carries: every attribute but those named in :attr:`_live`."""
        state = self.__dict__.copy()
        for name in self._live:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled sink in this process, then open its live resources (:meth:`_open_live`)."""
        self.__dict__.update(state)
        for name in self._live:
            setattr(self, name, None)
        self._open_live()

    def _open_live(self) -> None:
        """Open this process's resources of the sink (the attributes named in :attr:`_live`).

        Called by unpickling; a sink whose constructor opens them calls it too, so that a copy
        in another process opens them, with the same checks and errors, exactly as the original
        did. The default opens nothing.
        """

    def start_run(self, run: RunInfo) -> None:
        """Called once when a run starts, before any of its records."""

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Store or show one block of records (step order) and the events raised with them."""
        raise NotImplementedError

    def end_run(self, run: RunInfo) -> None:
        """Called once when a run ends, after all of its records; ``run.status`` is final."""

    def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
        """``Tap.watch()`` began epoch ``epoch`` of a loader of ``total`` batches (None: no
        ``len()``). Sent through the pipeline like records, so it may arrive while the previous
        epoch's last records are still on their way: key what it tells by ``epoch``."""

    def flush(self) -> None:
        """Make everything written so far durable or visible."""

    def last_step(self, run_id: str) -> int | None:
        """The largest step stored for ``run_id``, or None when unknown (``tap.run(resume=...)``
        asks the sinks that can answer: the SQL sinks)."""
        return None

    def run_name(self, run_id: str) -> str | None:
        """The name ``run_id`` was stored under, or None when unknown (a resumed run without a
        ``name=`` keeps it)."""
        return None

    def close(self) -> None:
        """Release resources. The sink is not used afterwards."""
