"""Opening connections to a store, shared by the SQL sinks and the reader."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from batchtap._optional import require
from batchtap.store.errors import StoreError
from batchtap.store.schema import POSTGRES, SCHEMA_VERSION, SQLITE, _current_version, ensure_schema
from batchtap.store.url import redact_dsn, redact_message, resolvable_dsn

__all__ = ["connect_sqlite", "connect_postgres", "ConnectionPool"]


def _network_options(
    psycopg: Any, dsn: str, network_timeout_s: float | None, statement_timeout_s: float | None
) -> dict[str, Any]:
    """libpq settings that give every network wait a deadline, unless the DSN sets them itself.

    Keepalives find a peer that vanished while the connection was idle; ``tcp_user_timeout``
    one that stopped acknowledging what was sent; ``statement_timeout`` a server that is up but
    stuck. (A peer that acknowledges but never answers needs a client-side deadline as well:
    :class:`batchtap.store.deadline.Watchdog`.)
    """
    try:
        given = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.Error:
        given = {}  # psycopg.connect reports the malformed DSN itself
    out: dict[str, Any] = {}
    if network_timeout_s is not None:
        t = max(1, round(network_timeout_s))
        wanted = {
            "keepalives": 1,
            "keepalives_idle": max(1, t // 3),
            "keepalives_interval": max(1, t // 9),
            "keepalives_count": 3,
            "tcp_user_timeout": t * 1000,
        }
        out.update({k: v for k, v in wanted.items() if k not in given})
    if statement_timeout_s is not None:
        setting = f"-c statement_timeout={max(1, round(statement_timeout_s * 1000))}"
        options = str(given.get("options", ""))
        if "statement_timeout" not in options:
            out["options"] = f"{options} {setting}".strip()
    return out


def _dsn_options(psycopg: Any, dsn: str) -> str:
    try:
        return str(psycopg.conninfo.conninfo_to_dict(dsn).get("options", ""))
    except psycopg.Error:
        return ""


def connect_sqlite(
    path: str | os.PathLike[str], *, create: bool, busy_timeout_s: float = 10.0, migrate: bool = True
) -> sqlite3.Connection:
    """Open a SQLite store: with ``create`` for writing (made when missing, WAL mode, schema up
    to date), else for reading only.

    A file that is not a batchtap store is refused before anything is written to it: its tables
    are read first, and only a batchtap store (or an empty file) is switched to WAL mode. A
    reader opens the file read-only (``mode=ro``), never changes its journal mode, and writes
    only to apply the migrations an older store lacks; on a read-only file system, where SQLite
    cannot make the WAL index, it reads the file as immutable.

    The connection is in autocommit mode (``isolation_level=None``): writers open their
    transactions explicitly with :func:`batchtap.store.schema.transaction`. It may be used from a
    thread other than the one that opened it (batchtap writes from its dispatcher thread), one
    thread at a time.

    ``migrate=False`` (a reader that must never write, such as the browser view) refuses an older
    store instead of migrating it.

    Raises:
        StoreError: the file cannot be created or opened, is not a SQLite database, is not a
            batchtap store, or has a newer schema version (or an older one with ``migrate=False``).
    """
    p = Path(path)
    where = str(p)
    _refuse_foreign_wal(p, where, busy_timeout_s)
    if not create:
        return _open_reader(p, where, busy_timeout_s, migrate)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot create the directory of SQLite store {where}: {exc.strerror or exc}; "
            "expected a writable location; fix: choose another path or fix its permissions"
        ) from exc
    conn = _open(str(p), where, busy_timeout_s, uri=False)
    try:
        # What the file is, before any pragma that writes: a foreign database stays untouched.
        _current_version(conn, SQLITE, where)
        mode = _switch_to_wal(conn, busy_timeout_s)
        if str(mode).lower() != "wal":
            raise StoreError(
                f"SQLite store {where} could not switch to WAL journaling (got {mode!r}); "
                "expected a local file system that supports shared memory; fix: use a local disk"
            )
        # WAL + NORMAL: a committed block survives a crash of the process (the tested case);
        # only an OS crash or power loss can lose the last commits, never corrupt the file.
        conn.execute("PRAGMA synchronous = NORMAL")
        ensure_schema(conn, SQLITE, where=where, create=True)
    except BaseException as exc:
        conn.close()
        raise _store_error(exc, where) from exc
    return conn


def _refuse_foreign_wal(p: Path, where: str, busy_timeout_s: float) -> None:
    """Refuse a WAL-mode file that is not a batchtap store without creating anything beside it.

    Any connection to a WAL-mode database, read-only ones included, makes its ``-wal`` and ``-shm``
    files, and a read-only one leaves them behind. When the file has no ``-wal`` file beside it,
    everything it holds is in the file itself, so it is identified through an ``immutable``
    connection, which creates nothing; a foreign one is refused there.
    """
    try:
        with p.open("rb") as f:
            header = f.read(100)
    except OSError:
        return  # missing or unreadable: the open below says so
    wal_mode = len(header) == 100 and header.startswith(b"SQLite format 3\x00") and header[18:20] == b"\x02\x02"
    if not wal_mode or Path(f"{p}-wal").exists():
        return
    probe = _open(p.resolve().as_uri() + "?mode=ro&immutable=1", where, busy_timeout_s, uri=True)
    try:
        _current_version(probe, SQLITE, where)
    except StoreError:
        raise
    except sqlite3.DatabaseError as exc:
        raise _store_error(exc, where) from exc
    finally:
        probe.close()


def _open(target: str, where: str, busy_timeout_s: float, *, uri: bool) -> sqlite3.Connection:
    try:
        return sqlite3.connect(target, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False, uri=uri)
    except sqlite3.Error as exc:
        raise StoreError(
            f"cannot open SQLite store {where}: {exc}; expected a readable and writable file "
            "(SQLite in WAL mode also writes -wal and -shm files next to it); "
            "fix: choose another path or fix its permissions"
        ) from exc


def _store_error(exc: BaseException, where: str) -> BaseException:
    if isinstance(exc, sqlite3.DatabaseError):
        return StoreError(
            f"cannot use {where} as a batchtap store: {exc}; expected a SQLite database written by "
            "bt.sinks.SQLite (or a new, writable path); fix: check the path and its permissions"
        )
    return exc


def _open_reader(p: Path, where: str, busy_timeout_s: float, migrate: bool) -> sqlite3.Connection:
    if not p.is_file():
        raise StoreError(
            f"no batchtap store at {where}: the file does not exist; expected a SQLite file "
            "written by bt.sinks.SQLite; fix: check the path"
        )
    base = p.resolve().as_uri()
    read_only_fs = not os.access(p.parent, os.W_OK)
    # mode=ro: a reader never creates a file, changes a journal mode or writes a page. On a
    # read-only file system SQLite cannot make the -shm index of a WAL file: read it as immutable
    # (nothing can be writing it there).
    targets = [base + "?mode=ro"] + ([base + "?mode=ro&immutable=1"] if read_only_fs else [])
    conn: sqlite3.Connection | None = None
    for i, target in enumerate(targets):
        conn = _open(target, where, busy_timeout_s, uri=True)
        try:
            version = _current_version(conn, SQLITE, where)
            break
        except sqlite3.OperationalError:
            conn.close()
            if i == len(targets) - 1:
                raise StoreError(
                    f"cannot read SQLite store {where}: SQLite cannot open it read-only; expected a readable "
                    "file (and, for a WAL file, its -shm/-wal files or a writable directory); fix: check "
                    "its permissions"
                ) from None
        except BaseException as exc:
            conn.close()
            raise _store_error(exc, where) from exc
    assert conn is not None
    if not migrate:
        try:
            refuse_older(version, where)
        except BaseException:
            conn.close()
            raise
        return conn
    try:
        ensure_schema(conn, SQLITE, where=where, create=False)
        return conn
    except StoreError:
        conn.close()
        raise
    except sqlite3.OperationalError as exc:
        if version is None or "readonly" not in str(exc).replace(" ", "").lower():
            conn.close()
            raise _store_error(exc, where) from exc
    # An older store: the one write a reader makes is the migration it lacks.
    conn.close()
    conn = _open(base + "?mode=rw", where, busy_timeout_s, uri=True)
    try:
        ensure_schema(conn, SQLITE, where=where, create=False)
    except BaseException as exc:
        conn.close()
        raise _store_error(exc, where) from exc
    return conn


def refuse_older(version: int | None, where: str) -> None:
    """Raise unless the store is at this batchtap's schema version (a reader that may not migrate).

    Raises:
        StoreError: empty, older or newer, with what to do about it.
    """
    if version is None:
        raise StoreError(
            f"{where} is empty, not a batchtap store; expected a store written by bt.sinks.SQLite or "
            "bt.sinks.Postgres; fix: check the path or URL (and --schema)"
        )
    if version < SCHEMA_VERSION:
        raise StoreError(
            f"{where} has schema version {version}, older than this batchtap's {SCHEMA_VERSION}; this reader "
            "opens stores read-only and does not migrate them; fix: run `batchtap runs --db ...` once (it "
            "migrates), then open it again"
        )
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{where} has schema version {version}, but this batchtap knows versions up to {SCHEMA_VERSION}; "
            "fix: upgrade batchtap (pip install -U batchtap)"
        )


def _switch_to_wal(conn: sqlite3.Connection, busy_timeout_s: float) -> str:
    """``PRAGMA journal_mode = WAL``, retried while another connection holds the lock.

    SQLite does not call the busy handler for a journal-mode change, so when several processes
    or threads create the same store at once all but one get "database is locked" at once
    (seen with 6 threads: ~4 % of tries). Once the file is in WAL mode the pragma takes no lock.
    """
    deadline = time.monotonic() + busy_timeout_s
    delay = 0.001
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as exc:
            if ("locked" not in str(exc) and "busy" not in str(exc)) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def connect_postgres(
    dsn: str,
    *,
    schema: str | None,
    create: bool,
    connect_timeout_s: float = 5.0,
    purpose: str,
    network_timeout_s: float | None = 30.0,
    statement_timeout_s: float | None = None,
    read_only: bool = False,
) -> Any:
    """Open a psycopg 3 connection (autocommit) to a PostgreSQL store, its schema up to date.

    Args:
        dsn: libpq URL or ``key=value`` string.
        schema: PostgreSQL schema (namespace) holding the tables; created when missing if
            ``create``. ``None`` uses the server's ``search_path`` (normally ``public``).
        create: create the tables in an empty schema.
        connect_timeout_s: give up connecting after this long.
        purpose: who asks, for the install hint when psycopg is missing.
        network_timeout_s: TCP keepalive and ``tcp_user_timeout`` settings so that the kernel
            declares a silent peer dead after about this long (``None``: libpq's defaults).
            Settings the DSN gives itself win.
        statement_timeout_s: the server cancels any statement running longer (``None``: the
            server's setting).
        read_only: every transaction of the session is read-only (the server refuses any write),
            and an older schema is refused instead of migrated.

    Raises:
        StoreError: the server cannot be reached or the schema is not usable; the message names
            the DSN without its password.
    """
    psycopg = require("psycopg", extra="postgres", purpose=purpose)
    shown = redact_dsn(dsn)
    dsn = resolvable_dsn(dsn)  # no piece of a password may reach the name resolver as a host name
    options = _network_options(psycopg, dsn, network_timeout_s, statement_timeout_s)
    if read_only:
        given = options.get("options") or _dsn_options(psycopg, dsn)
        options["options"] = f"{given} -c default_transaction_read_only=on".strip()
    try:
        conn = psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=max(1, round(connect_timeout_s)),
            application_name="batchtap-reader" if read_only else "batchtap",
            **options,
        )
    except psycopg.Error as exc:
        # libpq's messages name host and port, never the password; the DSN we print is redacted.
        reason = redact_message(str(exc).strip().replace("\n", " "), dsn)
        raise StoreError(
            f"cannot connect to PostgreSQL at {shown}: {reason}; expected a reachable server "
            "accepting this user and database; fix: check host, port, user, database and that the "
            "server is running"
        ) from None
    try:
        if schema is not None:
            sql = require("psycopg.sql", extra="postgres", purpose=purpose)
            if create:
                try:
                    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
                except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateSchema):
                    pass  # another process created it at the same moment (IF NOT EXISTS is not atomic)
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        where = shown if schema is None else f"{shown} (schema {schema!r})"
        if read_only:
            refuse_older(_current_version(conn, POSTGRES, where), where)
        else:
            ensure_schema(conn, POSTGRES, where=where, create=create)
    except StoreError:
        conn.close()
        raise
    except psycopg.Error as exc:
        conn.close()
        reason = redact_message(str(exc).strip().replace("\n", " "), dsn)
        raise StoreError(
            f"cannot use PostgreSQL at {shown} as a batchtap store: {reason}; expected permission to "
            "create and write tables; fix: grant them or choose another database or schema"
        ) from None
    return conn


class ConnectionPool:
    """Read connections shared by a reader's threads: each call takes one no other thread is using,
    and gives it back; bounded, and closed when idle.

    A connection per thread that lives as long as its thread leaks when the threads come and go (a
    server's worker threads end after a few idle seconds and new ones start with the next burst):
    each leaked SQLite connection holds a file descriptor and maps the file. Here at most ``size``
    connections are open at once (a caller past that waits for one to come back), at most ``keep``
    wait idle between calls, and an idle one is closed after ``idle_s`` seconds.

    Args:
        opener: opens one connection (called outside the pool's lock).
        size: most connections open at once.
        keep: most idle connections kept for the next call.
        idle_s: an idle connection is closed after this many seconds.

    Example:
        >>> import sqlite3
        >>> pool = ConnectionPool(lambda: sqlite3.connect(":memory:", check_same_thread=False))
        >>> with pool.connection() as conn:
        ...     conn.execute("SELECT 1").fetchone()
        (1,)
        >>> pool.open_count
        1
        >>> pool.close(); pool.open_count
        0
    """

    def __init__(self, opener: Callable[[], Any], *, size: int = 8, keep: int = 2, idle_s: float = 10.0) -> None:
        if size < 1 or keep < 0 or idle_s <= 0:
            raise ValueError(f"size must be >= 1, keep >= 0 and idle_s > 0, got {size}, {keep}, {idle_s}")
        self._opener = opener
        self._keep = keep
        self._idle_s = idle_s
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[tuple[Any, float]] = []  # (connection, when it came back), oldest first
        self._open = 0
        self._closed = False
        self._timer: threading.Timer | None = None

    @property
    def open_count(self) -> int:
        """Connections open now (in use or idle)."""
        return self._open

    @contextlib.contextmanager
    def connection(self) -> Iterator[Any]:
        """A connection for this call only; given back (or closed) when the block ends."""
        self._slots.acquire()
        try:
            conn = self._take()
            try:
                yield conn
            finally:
                self._give(conn)
        finally:
            self._slots.release()

    def _take(self) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("the store was closed; fix: open it again")
            if self._idle:
                return self._idle.pop()[0]  # the most recently used: its pages are warm
            self._open += 1
        try:
            return self._opener()
        except BaseException:
            with self._lock:
                self._open -= 1
            raise

    def _give(self, conn: Any) -> None:
        with self._lock:
            keep = not self._closed and len(self._idle) < self._keep
            if keep:
                self._idle.append((conn, time.monotonic()))
                if self._timer is None:
                    self._arm()
            else:
                self._open -= 1
        if not keep:
            _close_quietly(conn)

    def _arm(self) -> None:
        # under self._lock
        self._timer = threading.Timer(self._idle_s, self._reap)
        self._timer.daemon = True
        self._timer.start()

    def _reap(self) -> None:
        """Close the connections idle for ``idle_s`` seconds (runs on a timer thread)."""
        cutoff = time.monotonic() - self._idle_s
        with self._lock:
            old = [c for c, t in self._idle if t <= cutoff]
            self._idle = [(c, t) for c, t in self._idle if t > cutoff]
            self._open -= len(old)
            self._timer = None
            if self._idle and not self._closed:
                self._arm()
        for conn in old:
            _close_quietly(conn)

    def close(self) -> None:
        """Close the idle connections now; those in use are closed when they come back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        for conn in idle:
            _close_quietly(conn)


def _close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - a connection that cannot close cleanly is gone either way
        pass
