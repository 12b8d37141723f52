"""``Postgres(dsn)``: the shared store, same schema as SQLite, through psycopg 3."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from batchtap.errors import ConfigError, SinkError
from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.base import Sink, require
from batchtap.store._conn import connect_postgres
from batchtap.store._errors import StoreError
from batchtap.store._url import redact_dsn
from batchtap.store.schema import (
    ENSURE_RUN,
    INSERT_EVENTS,
    INSERT_SPARSE,
    LAST_STEP,
    METRIC_COLUMNS,
    POSTGRES,
    UPSERT_RUN,
    dedupe_metric_rows,
    event_rows,
    metric_rows,
    run_row,
    run_rows_for_records,
    sparse_rows,
    transaction,
    upsert_metrics_from,
)

__all__ = ["Postgres"]

_STAGE = "batchtap_stage_metrics"
# PostgreSQL types of METRIC_COLUMNS, for binary COPY.
_STAGE_TYPES = ["text", "text", "int8", "int8", "int8", "int8", "float8", "float8"]


class Postgres(Sink):
    """Store runs, metric values and events in PostgreSQL (schema: :mod:`batchtap.store.schema`).

    * One transaction per ``write()`` block. Metric values go in by ``COPY`` into a per-connection
      temporary staging table and one ``INSERT ... SELECT ... ON CONFLICT DO UPDATE``, so a replayed
      block stores nothing twice. The names of sparse records (``Tap.log()``) are also noted in
      ``sparse_metrics``.
    * Reconnects when the server goes away, with exponential backoff between attempts. The backoff
      never sleeps: while waiting, ``write()`` raises :class:`~batchtap.errors.SinkError` at once,
      and the caller (the dispatcher's :class:`batchtap.pipeline.resilient.ResilientSink`) spools
      the block and replays it later.
    * The constructor connects and creates the schema, so an unreachable server fails before
      training starts; errors show the DSN with its password replaced by ``***``.

    Args:
        dsn: libpq URL (``postgresql://user:pw@host:5432/db``) or ``key=value`` string.
        schema: PostgreSQL schema (namespace) for the tables, created when missing; ``None`` uses
            the server's ``search_path`` (normally ``public``).
        connect_timeout_s: give up a connection attempt after this long.
        reconnect_initial_s: wait before the first reconnect attempt after a failed one.
        reconnect_max_s: longest wait between reconnect attempts.

    Raises:
        SinkError: (a :class:`batchtap.store.StoreError`) the server cannot be reached, or the
            database is not a batchtap store, or its schema version is newer.
        ImportError: psycopg is not installed (``pip install 'batchtap[postgres]'``).
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str | None = None,
        connect_timeout_s: float = 5.0,
        reconnect_initial_s: float = 0.5,
        reconnect_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < reconnect_initial_s <= reconnect_max_s:
            raise ConfigError(
                "need 0 < reconnect_initial_s <= reconnect_max_s, got "
                f"{reconnect_initial_s} and {reconnect_max_s}"
            )
        if schema is not None and not schema:
            raise ConfigError("schema must be a non-empty name or None, got ''")
        self._psycopg = require("psycopg", extra="postgres", purpose="bt.sinks.Postgres")
        self._dsn = dsn
        #: the DSN as safe to print (password replaced by ``***``).
        self.dsn = redact_dsn(dsn)
        self.schema = schema
        self._connect_timeout_s = connect_timeout_s
        self._initial = reconnect_initial_s
        self._max = reconnect_max_s
        self._delay = reconnect_initial_s
        self._next_attempt = 0.0
        self._clock = clock
        self._closed = False
        self._conn: Any = None
        self._conn = self._connect()  # fail at construction, not at the first block
        self._upsert_metrics = upsert_metrics_from(_STAGE)
        self._insert_events = POSTGRES.q(INSERT_EVENTS)
        self._insert_sparse = POSTGRES.q(INSERT_SPARSE)
        self._ensure_run = POSTGRES.q(ENSURE_RUN)
        self._upsert_run = POSTGRES.q(UPSERT_RUN)

    # -- connection -------------------------------------------------------------------------
    def _connect(self) -> Any:
        conn = connect_postgres(
            self._dsn,
            schema=self.schema,
            create=True,
            connect_timeout_s=self._connect_timeout_s,
            purpose="bt.sinks.Postgres",
        )
        # Temporary tables live per connection, so every (re)connection makes its own.
        conn.execute(
            f"CREATE TEMPORARY TABLE IF NOT EXISTS {_STAGE} (LIKE metrics INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
        )
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except self._psycopg.Error:
                pass  # already broken; dropping it is all we want
            self._conn = None

    def _connection(self) -> Any:
        if self._closed:
            raise SinkError(f"bt.sinks.Postgres({self.dsn!r}) is closed; expected an open sink; fix: make a new one")
        conn = self._conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self._drop()
        now = self._clock()
        if now < self._next_attempt:
            raise SinkError(
                f"PostgreSQL at {self.dsn} is unreachable; next reconnect attempt in "
                f"{self._next_attempt - now:.1f} s (backing off)"
            )
        try:
            self._conn = self._connect()
        except StoreError as exc:
            self._next_attempt = now + self._delay
            self._delay = min(self._delay * 2, self._max)
            raise SinkError(f"{exc} (reconnecting with backoff, next attempt in {self._next_attempt - now:.1f} s)") from None
        self._delay = self._initial
        self._next_attempt = 0.0
        return self._conn

    def _transact(self, what: str, body: Callable[[Any], None]) -> None:
        """Run ``body(conn)`` in one transaction; a connection that died since the last block is
        replaced once, at once (the server probably restarted), before giving up."""
        psycopg = self._psycopg
        for attempt in (1, 2):
            conn = self._connection()
            try:
                with transaction(conn, POSTGRES):
                    body(conn)
                return
            except psycopg.OperationalError as exc:
                self._drop()
                if attempt == 2:
                    reason = str(exc).strip().replace("\n", " ")
                    raise SinkError(
                        f"cannot {what} in PostgreSQL at {self.dsn}: {reason}; the block was not stored "
                        "(rolled back); it can be written again later"
                    ) from None
            except psycopg.Error as exc:
                reason = str(exc).strip().replace("\n", " ")
                raise SinkError(f"cannot {what} in PostgreSQL at {self.dsn}: {reason}") from None

    # -- sink -------------------------------------------------------------------------------
    def start_run(self, run: RunInfo) -> None:
        """Insert (or, on resume, update) the run's row with status ``running``."""
        row = run_row(run)
        self._transact(f"store run {run.id}", lambda conn: conn.execute(self._upsert_run, row))

    def end_run(self, run: RunInfo) -> None:
        """Store the run's final status, end time and stop reason."""
        self.start_run(run)

    def last_step(self, run_id: str) -> int | None:
        """The largest step of ``run_id``'s step values (None when it has none); values logged with
        ``Tap.log()`` do not count, as they may name any step."""
        found: list[int | None] = []
        last_step = POSTGRES.q(LAST_STEP)

        def body(conn: Any) -> None:
            row = conn.execute(last_step, (run_id, run_id)).fetchone()
            found.append(None if row is None or row[0] is None else int(row[0]))

        self._transact(f"read the last step of run {run_id}", body)
        return found[0]

    def run_name(self, run_id: str) -> str | None:
        """The name ``run_id`` is stored under (None when this store does not hold it)."""
        found: list[str | None] = []

        def body(conn: Any) -> None:
            row = conn.execute("SELECT name FROM runs WHERE id = %s", (run_id,)).fetchone()
            found.append(None if row is None else str(row[0]))

        self._transact(f"read the name of run {run_id}", body)
        return found[0]

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Store one block in one transaction (all of it or, on error, none of it)."""
        if not records and not events:
            return
        rows = dedupe_metric_rows(metric_rows(records))
        runs = run_rows_for_records(records)
        sparse = sparse_rows(records)
        evs = event_rows(events)

        def body(conn: Any) -> None:
            cur = conn.cursor()
            if runs:
                cur.executemany(self._ensure_run, runs)
            if rows:
                # Binary COPY: about twice the rate of text COPY, and floats travel bit-exact.
                with cur.copy(f"COPY {_STAGE} ({', '.join(METRIC_COLUMNS)}) FROM STDIN (FORMAT BINARY)") as copy:
                    copy.set_types(_STAGE_TYPES)
                    for row in rows:
                        copy.write_row(row)
                cur.execute(self._upsert_metrics)
            if sparse:
                cur.executemany(self._insert_sparse, sparse)
            if evs:
                cur.executemany(self._insert_events, evs)

        self._transact(f"write {len(rows)} values and {len(evs)} events", body)

    def flush(self) -> None:
        """Nothing to do: every block is committed when ``write()`` returns."""

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self._closed = True
        self._drop()
