"""``Postgres(dsn)``: the shared store, same schema as SQLite, through psycopg 3."""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchtap.errors import ConfigError, SinkError
from batchtap.records import Event, EventKind, Record, RunInfo
from batchtap.sinks.base import Sink, SinkDataError, require
from batchtap.store.connect import connect_postgres
from batchtap.store.deadline import Watchdog
from batchtap.store.errors import StoreError
from batchtap.store.schema import (
    ENSURE_RUN,
    INSERT_EVENTS,
    INSERT_SPARSE,
    LAST_STEP,
    METRIC_COLUMNS,
    POSTGRES,
    UPSERT_HISTOGRAMS,
    UPSERT_RUN,
    dedupe_metric_rows,
    event_rows,
    histogram_rows,
    metric_rows,
    run_row,
    run_rows_for_records,
    sparse_rows,
    transaction,
    upsert_metrics_from,
)
from batchtap.store.split import Row, describe_rejected, store_what_fits
from batchtap.store.url import redact_dsn, redact_message

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
      and the caller (the dispatcher's :class:`batchtap.sinks.resilient.ResilientSink`) spools
      the block and replays it later.
    * The constructor connects and creates the schema, so an unreachable server fails before
      training starts; errors show the DSN with its password replaced by ``***``.
    * Every network wait has a deadline: connecting (``connect_timeout_s``), and every
      operation (``timeout_s``: libpq TCP keepalives and ``tcp_user_timeout``, the server's
      ``statement_timeout``, and a client-side watchdog that cuts the connection when the server
      keeps it open but stops answering). An operation past its deadline fails like a lost
      connection: :class:`~batchtap.errors.SinkError`, the block is spooled by a
      ``ResilientSink`` or reported lost, and training goes on.
    * A block the server refuses for what it holds (a NUL character in a name, which PostgreSQL
      text cannot hold) is stored in parts: everything else of it is stored, the refused rows
      are reported as a WARNING event (:meth:`take_events`), and ``write()`` returns normally.
      NUL characters in event messages are stored escaped (``\\x00``).

    Args:
        dsn: libpq URL (``postgresql://user:pw@host:5432/db``) or ``key=value`` string.
        schema: PostgreSQL schema (namespace) for the tables, created when missing; ``None`` uses
            the server's ``search_path`` (normally ``public``).
        connect_timeout_s: give up a connection attempt after this long.
        reconnect_initial_s: wait before the first reconnect attempt after a failed one.
        reconnect_max_s: longest wait between reconnect attempts.
        timeout_s: longest one operation (a block's transaction, a query) may take before the
            connection is given up as dead.

    Raises:
        SinkError: (a :class:`batchtap.store.StoreError`) the server cannot be reached, or the
            database is not a batchtap store, or its schema version is newer.
        ImportError: psycopg is not installed (``pip install 'batchtap[postgres]'``).
    """

    _live = ("_psycopg", "_watchdog", "_lock", "_conn")

    def __init__(
        self,
        dsn: str,
        *,
        schema: str | None = None,
        connect_timeout_s: float = 5.0,
        reconnect_initial_s: float = 0.5,
        reconnect_max_s: float = 30.0,
        timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s and math.isfinite(timeout_s)):
            raise ConfigError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
        if not 0 < reconnect_initial_s <= reconnect_max_s:
            raise ConfigError(
                f"need 0 < reconnect_initial_s <= reconnect_max_s, got {reconnect_initial_s} and {reconnect_max_s}"
            )
        if schema is not None and not schema:
            raise ConfigError("schema must be a non-empty name or None, got ''")
        require("psycopg", extra="postgres", purpose="bt.sinks.Postgres")
        self._dsn = dsn
        #: the DSN as safe to print (password replaced by ``***``).
        self.dsn = redact_dsn(dsn)
        self.schema = schema
        self._connect_timeout_s = connect_timeout_s
        self._initial = reconnect_initial_s
        self._max = reconnect_max_s
        self._clock = clock
        self._timeout_s = float(timeout_s)
        self._upsert_metrics = upsert_metrics_from(_STAGE)
        self._insert_events = POSTGRES.q(INSERT_EVENTS)
        self._insert_sparse = POSTGRES.q(INSERT_SPARSE)
        self._upsert_histograms = POSTGRES.q(UPSERT_HISTOGRAMS)
        self._ensure_run = POSTGRES.q(ENSURE_RUN)
        self._upsert_run = POSTGRES.q(UPSERT_RUN)
        self._open_live()  # fail at construction, not at the first block

    def _open_live(self) -> None:
        """Connect, with a fresh reconnect backoff and watchdog (a copy unpickled in another
        process makes its own, and is open even when the original was closed)."""
        self._psycopg = require("psycopg", extra="postgres", purpose="bt.sinks.Postgres")
        self._delay = self._initial
        self._next_attempt = 0.0
        self._closed = False
        self._watchdog = Watchdog("postgres")
        self._events: list[Event] = []  # the original reports its own
        self._lock = threading.Lock()
        self._conn: Any = None
        self._conn = self._connect()

    # -- connection -------------------------------------------------------------------------
    def _connect(self) -> Any:
        conn = connect_postgres(
            self._dsn,
            schema=self.schema,
            create=True,
            connect_timeout_s=self._connect_timeout_s,
            purpose="bt.sinks.Postgres",
            network_timeout_s=self._timeout_s,
            statement_timeout_s=self._timeout_s,
        )
        try:
            # Temporary tables live per connection, so every (re)connection makes its own.
            with self._deadline(conn):
                conn.execute(
                    f"CREATE TEMPORARY TABLE IF NOT EXISTS {_STAGE} (LIKE metrics INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"
                )
        except self._psycopg.Error as exc:
            conn.close()
            raise StoreError(f"cannot prepare PostgreSQL at {self.dsn}: {_reason(exc, self._watchdog)}") from None
        return conn

    def _deadline(self, conn: Any) -> Any:
        """Arm the watchdog for one operation on ``conn``: past ``timeout_s`` its socket is shut
        down, so the blocked read fails at once instead of waiting forever."""
        try:
            fd = conn.pgconn.socket
        except Exception:  # noqa: BLE001 - no socket: nothing can block on it
            fd = -1

        def cut() -> None:
            if fd < 0:
                return
            # a duplicate of the descriptor: shutting it down affects the one socket both name,
            # while closing stays with psycopg (closing its fd under it could hit a reused number)
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()

        return self._watchdog.armed(self._timeout_s, cut)

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
            raise SinkError(
                f"{exc} (reconnecting with backoff, next attempt in {self._next_attempt - now:.1f} s)"
            ) from None
        self._delay = self._initial
        self._next_attempt = 0.0
        return self._conn

    def _transact(self, what: str, body: Callable[[Any], None]) -> None:
        """Run ``body(conn)`` in one transaction, within ``timeout_s``; a connection that died
        since the last block is replaced once, at once (the server probably restarted), before
        giving up. A server that stopped answering is not retried at once: it is backed off."""
        psycopg = self._psycopg
        with self._lock:
            for attempt in (1, 2):
                conn = self._connection()
                try:
                    with self._deadline(conn), transaction(conn, POSTGRES):
                        body(conn)
                    return
                except psycopg.OperationalError as exc:
                    self._drop()
                    stalled = self._watchdog.expired
                    if stalled:
                        # a server that stopped answering: back off rather than wait again at once
                        now = self._clock()
                        self._next_attempt = now + self._delay
                        self._delay = min(self._delay * 2, self._max)
                    if attempt == 2 or stalled:
                        raise SinkError(
                            f"cannot {what} in PostgreSQL at {self.dsn}: "
                            f"{redact_message(_reason(exc, self._watchdog, self._timeout_s), self._dsn)}; "
                            "the block was not stored (rolled back); it can be written again later"
                        ) from None
                except (psycopg.DataError, psycopg.IntegrityError) as exc:
                    raise SinkDataError(f"cannot {what} in PostgreSQL at {self.dsn}: {_reason(exc)}") from None
                except psycopg.Error as exc:
                    reason = redact_message(_reason(exc), self._dsn)
                    raise SinkError(f"cannot {what} in PostgreSQL at {self.dsn}: {reason}") from None

    # -- sink -------------------------------------------------------------------------------
    def start_run(self, run: RunInfo) -> None:
        """Insert (or, on resume, update) the run's row with status ``running``."""
        row = run_row(run)
        # a stop reason may quote anything (an exception's text): keep it, escaped, not the NUL
        row = tuple(v.replace("\x00", "\\x00") if i in (1, 5) and isinstance(v, str) else v for i, v in enumerate(row))
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
        """Store one block in one transaction (all of it or, on a connection error, none of it).

        Rows the server refuses for what they hold are left out and reported (see the class
        docs); the rest of the block is stored.
        """
        if not records and not events:
            return
        rows: list[Row] = [("runs", r) for r in run_rows_for_records(records)]
        rows += [("metrics", r) for r in dedupe_metric_rows(metric_rows(records))]
        rows += [("sparse", r) for r in sparse_rows(records)]
        rows += [("histograms", r) for r in histogram_rows(records)]
        rows += [("events", _escape_nul(r)) for r in event_rows(events)]
        try:
            self._write_rows(rows)
        except SinkDataError:
            rejected = store_what_fits(rows, self._write_rows, lambda e: isinstance(e, SinkDataError))
            if rejected:
                first = records[0] if records else None
                message = describe_rejected(rejected, sink=f"Postgres({self.dsn})", total=len(rows))
                self._events.append(
                    Event(
                        first.run_id if first else (events[0].run_id if events else ""),
                        first.step if first else (events[0].step if events else 0),
                        EventKind.WARNING,
                        message,
                        time.time(),
                    )
                )

    def _write_rows(self, rows: Sequence[Row]) -> None:
        runs = [r for t, r in rows if t == "runs"]
        values = [r for t, r in rows if t == "metrics"]
        sparse = [r for t, r in rows if t == "sparse"]
        histograms = [r for t, r in rows if t == "histograms"]
        evs = [r for t, r in rows if t == "events"]

        def body(conn: Any) -> None:
            cur = conn.cursor()
            if runs:
                cur.executemany(self._ensure_run, runs)
            if values:
                # Binary COPY: about twice the rate of text COPY, and floats travel bit-exact.
                with cur.copy(f"COPY {_STAGE} ({', '.join(METRIC_COLUMNS)}) FROM STDIN (FORMAT BINARY)") as copy:
                    copy.set_types(_STAGE_TYPES)
                    for row in values:
                        copy.write_row(row)
                cur.execute(self._upsert_metrics)
            if sparse:
                cur.executemany(self._insert_sparse, sparse)
            if histograms:
                cur.executemany(self._upsert_histograms, histograms)
            if evs:
                cur.executemany(self._insert_events, evs)

        self._transact(f"write {len(values)} values and {len(evs)} events", body)

    def take_events(self) -> list[Event]:
        """WARNING events about rows this sink refused since the last call."""
        out, self._events = self._events, []
        return out

    def flush(self) -> None:
        """Nothing to do: every block is committed when ``write()`` returns."""

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self._closed = True
        self._drop()
        self._watchdog.close()


def _reason(exc: BaseException, watchdog: Watchdog | None = None, timeout_s: float = 0.0) -> str:
    text = str(exc).strip().replace("\n", " ")
    if watchdog is not None and watchdog.expired:
        return f"the server did not answer within timeout_s={timeout_s:g} s (connection cut: {text})"
    return text


def _escape_nul(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """An event row with NUL characters in its message escaped (PostgreSQL text cannot hold them)."""
    message = row[7]
    if isinstance(message, str) and "\x00" in message:
        return (*row[:7], message.replace("\x00", "\\x00"), *row[8:])
    return row
