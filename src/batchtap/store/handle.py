"""The connection side of a store reader: a bounded pool of read connections, the SQL dialect,
read-only statements and the life cycle. :class:`~batchtap.store.reader.Store` adds the queries
(runs, metric series, summaries, events) on top; :func:`batchtap.store.open` makes one."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from batchtap.store.connect import ConnectionPool
from batchtap.store.schema import Dialect

__all__ = ["ReadHandle"]

_H = TypeVar("_H", bound="ReadHandle")


class ReadHandle:
    """Connections to one store, for reading: shared by the caller's threads through ``pool``
    (one connection per concurrent call, closed when idle). Use it as a context manager.

    Args:
        pool: the pool of read connections.
        dialect: the store's SQL dialect.
        where: the store's location, safe to print (no password).
    """

    def __init__(self, pool: ConnectionPool, dialect: Dialect, where: str) -> None:
        self._pool = pool
        self._d = dialect
        #: the store's location, safe to print (no password).
        self.where = where

    @property
    def dialect(self) -> Dialect:
        """The store's SQL dialect (:data:`~batchtap.store.schema.SQLITE` or ``POSTGRES``)."""
        return self._d

    @property
    def open_connections(self) -> int:
        """Connections open now (bounded; idle ones close after a few seconds)."""
        return self._pool.open_count

    def close(self) -> None:
        """Close the connections (one in use by another thread closes when its call ends)."""
        self._pool.close()

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one read-only statement (``?`` placeholders, values only as ``params``): the
        decimation queries of the browser view. The connection refuses writes."""
        return self._all(sql, tuple(params))

    def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._pool.connection() as conn:
            return list(conn.execute(self._d.q(sql), params).fetchall())

    def _stream(self, sql: str, params: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
        """Rows one at a time, the connection held until the last is read (a whole run's values
        need not fit in memory)."""
        with self._pool.connection() as conn:
            yield from conn.execute(self._d.q(sql), params)
