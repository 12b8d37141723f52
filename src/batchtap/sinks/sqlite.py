"""``SQLite(path)``: the embedded default store (``batchtap demo`` writes ``runs/batchtap.db``)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from batchtap.errors import SinkError
from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.base import Sink
from batchtap.store.connect import connect_sqlite
from batchtap.store.locks import describe_lock
from batchtap.store.schema import (
    ENSURE_RUN,
    INSERT_EVENTS,
    INSERT_SPARSE,
    LAST_STEP,
    SQLITE,
    UPSERT_HISTOGRAMS,
    UPSERT_METRICS,
    UPSERT_RUN,
    event_rows,
    histogram_rows,
    metric_rows,
    run_row,
    run_rows_for_records,
    sparse_rows,
    transaction,
)
from batchtap.store.url import parse_url

__all__ = ["SQLite"]


class SQLite(Sink):
    """Store runs, metric values and events in a SQLite file (schema: :mod:`batchtap.store.schema`).

    * WAL journaling: readers (``batchtap.store.open``, the CLI, another ``sqlite3``) follow the
      file while training writes, and never block the writer.
    * One transaction per ``write()`` block: a crash leaves whole blocks only.
    * Idempotent: a value is keyed by (run, metric, step, rank) and an event by its content, so
      writing a block twice (a replay from the spool) stores it once.
    * NaN values are stored as SQL ``NULL``; :func:`batchtap.store.open` reads them back as ``nan``.
    * Sparse records (``Tap.log()``) are metric rows like any other; their names are also noted in
      ``sparse_metrics``.

    The file and its directory are created and checked in the constructor, so a bad path fails
    before training starts.

    Args:
        path: file path or ``sqlite:///path``.
        busy_timeout_s: how long a write waits for another process holding the write lock.

    Raises:
        SinkError: (a :class:`batchtap.store.StoreError`) the path is not writable, the file is not
            a batchtap store, or its schema version is newer than this batchtap's.

    Example:
        >>> import tempfile, os
        >>> sink = SQLite(os.path.join(tempfile.mkdtemp(), "runs", "bt.db"))
        >>> sink.write([Record("r1", step=0, epoch=0, batch=0, rank=0, wall_time=0.0, values={"loss": 1.0})])
        >>> sink.close()
    """

    _live = ("_conn",)

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float = 10.0) -> None:
        loc = parse_url(path)
        if loc.kind != "sqlite":
            raise SinkError(
                f"bt.sinks.SQLite needs a file path or sqlite:///path, got {loc.display()!r}; "
                "fix: use bt.sinks.Postgres for a PostgreSQL URL"
            )
        self.path = loc.target
        self._busy_timeout_s = float(busy_timeout_s)
        self._conn: sqlite3.Connection | None = None
        self._open_live()
        self._upsert_metrics = SQLITE.q(UPSERT_METRICS)
        self._upsert_histograms = SQLITE.q(UPSERT_HISTOGRAMS)
        self._insert_events = SQLITE.q(INSERT_EVENTS)
        self._insert_sparse = SQLITE.q(INSERT_SPARSE)
        self._ensure_run = SQLITE.q(ENSURE_RUN)
        self._upsert_run = SQLITE.q(UPSERT_RUN)

    def _open_live(self) -> None:
        """Connect (a copy unpickled in another process makes its own connection)."""
        self._conn = connect_sqlite(self.path, create=True, busy_timeout_s=self._busy_timeout_s)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise SinkError(f"bt.sinks.SQLite({self.path!r}) is closed; expected an open sink; fix: make a new one")
        return self._conn

    def _upsert(self, run: RunInfo) -> None:
        conn = self._connection()
        try:
            with transaction(conn, SQLITE):
                conn.execute(self._upsert_run, run_row(run))
        except sqlite3.Error as exc:
            raise SinkError(f"cannot store run {run.id} in SQLite store {self.path}: {exc}; {self._fix(exc)}") from exc

    def start_run(self, run: RunInfo) -> None:
        """Insert (or, on resume, update) the run's row with status ``running``."""
        self._upsert(run)

    def end_run(self, run: RunInfo) -> None:
        """Store the run's final status, end time and stop reason."""
        self._upsert(run)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Store one block in one transaction (all of it or, on error, none of it)."""
        if not records and not events:
            return
        conn = self._connection()
        rows = metric_rows(records)
        sparse = sparse_rows(records)
        histograms = histogram_rows(records)
        try:
            with transaction(conn, SQLITE):
                # A run row for records whose start_run this sink never saw (attached mid-run).
                conn.executemany(self._ensure_run, run_rows_for_records(records))
                conn.executemany(self._upsert_metrics, rows)
                if sparse:
                    conn.executemany(self._insert_sparse, sparse)
                if histograms:
                    conn.executemany(self._upsert_histograms, histograms)
                if events:
                    conn.executemany(self._insert_events, event_rows(events))
        except sqlite3.Error as exc:
            raise SinkError(
                f"cannot write {len(rows)} values and {len(events)} events to SQLite store {self.path}: {exc}; "
                f"the block was not stored (nothing partial); {self._fix(exc)}"
            ) from exc

    def _fix(self, exc: sqlite3.Error) -> str:
        text = str(exc).lower()
        if "locked" in text or "busy" in text:
            return (
                f"the store's write lock is held by {describe_lock(Path(self.path))}, longer than "
                f"busy_timeout_s={self._busy_timeout_s:g} s; fix: wait for it to finish (a long transaction or an open "
                "sqlite3 shell), raise busy_timeout_s, or give the Tap a spool_dir so blocks are kept and retried "
                "meanwhile"
            )
        return "fix: check free disk space and permissions"

    def last_step(self, run_id: str) -> int | None:
        """The largest step of ``run_id``'s step values (None when it has none); values logged with
        ``Tap.log()`` do not count, as they may name any step."""
        row = self._connection().execute(SQLITE.q(LAST_STEP), (run_id, run_id)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    def run_name(self, run_id: str) -> str | None:
        """The name ``run_id`` is stored under (None when this store does not hold it)."""
        row = self._connection().execute("SELECT name FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else str(row[0])

    def flush(self) -> None:
        """Nothing to do: every block is committed when ``write()`` returns."""

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self._conn is not None:
            try:
                self._conn.execute("PRAGMA optimize")
            except sqlite3.Error:
                pass  # an optimisation hint only; closing must not fail on it
            self._conn.close()
            self._conn = None
