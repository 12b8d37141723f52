"""The one schema shared by the SQL sinks and the readers, rendered per SQL dialect.

Tables (schema version 2):

* ``runs`` — one row per run: id, name, status, start/end times, stop reason, config (JSON text),
  world size, host, pid, Python/torch/CUDA/cuDNN versions, git commit, device, the declared metric
  names (JSON list) and the whole environment dict (JSON text).
* ``metrics`` — long form, one row per (run, metric, step, rank) with epoch, batch, wall time and
  value. The primary key is in that order, so "one metric of one run in step order" is a range scan
  of the key and needs no extra index. A NaN value is stored as SQL ``NULL`` (SQLite cannot store
  NaN; using NULL in PostgreSQL too keeps one rule and makes ``avg(value)`` skip it).
* ``sparse_metrics`` — (run, metric) for each name a run logged with ``Tap.log()`` (records with
  ``Record.sparse``: evaluation, epoch-level values). Their values are ordinary ``metrics`` rows
  (``batch`` -1); this table only says which names they are, so that step counts leave them out and
  readers can show them apart. A name is sparse or per-step for a whole run (the Tap refuses a
  clash), so one row per name is enough and the hot per-step path writes nothing here.
* ``events`` — anomalies, actions, warnings, notes (``info``) and skipped steps: run, step, rank, kind, metric, raw
  value (as text by the record codec's rule, :func:`float_to_text`, so NaN and inf survive), message,
  wall time. An
  ``event_key`` (a hash of the event's fields) makes re-inserting the same event a no-op.
* ``schema_version`` — one row per applied migration. Opening a store applies the missing ones.

Every statement is written once, with ``?`` placeholders and ``{REAL}``-style type names, and
rendered for SQLite or PostgreSQL by a :class:`Dialect`. Both engines understand
``INSERT ... ON CONFLICT (...) DO UPDATE SET x = excluded.x``, which makes every write idempotent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from batchtap.records import Event, Record, RunInfo, format_float, parse_float
from batchtap.store.errors import StoreError

__all__ = [
    "SCHEMA_VERSION",
    "Dialect",
    "SQLITE",
    "POSTGRES",
    "Migration",
    "MIGRATIONS",
    "ensure_schema",
    "transaction",
    "metric_rows",
    "histogram_rows",
    "HISTOGRAM_PREFIX",
    "HISTOGRAM_COLUMNS",
    "UPSERT_HISTOGRAMS",
    "sparse_rows",
    "event_rows",
    "run_row",
    "run_rows_for_records",
    "float_to_text",
    "text_to_float",
    "UPSERT_METRICS",
    "upsert_metrics_from",
    "dedupe_metric_rows",
    "INSERT_EVENTS",
    "INSERT_SPARSE",
    "LAST_STEP",
    "UPSERT_RUN",
    "ENSURE_RUN",
    "RUN_COLUMNS",
    "METRIC_COLUMNS",
    "EVENT_COLUMNS",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Dialect:
    """How one SQL engine spells what the shared statements need.

    Attributes:
        name: ``"sqlite"`` or ``"postgresql"``.
        placeholder: the parameter marker of the driver (``?`` for sqlite3, ``%s`` for psycopg).
        types: type names substituted for ``{REAL}``, ``{INT}`` and ``{TEXT}`` in DDL.
        without_rowid: suffix for key-organised tables (SQLite's ``WITHOUT ROWID``).

    Example:
        >>> POSTGRES.q("SELECT value FROM metrics WHERE run_id = ?")
        'SELECT value FROM metrics WHERE run_id = %s'
        >>> SQLITE.ddl("CREATE TABLE t (x {REAL}){WITHOUT_ROWID}")
        'CREATE TABLE t (x REAL) WITHOUT ROWID'
    """

    name: Literal["sqlite", "postgresql"]
    placeholder: str
    types: Mapping[str, str]
    without_rowid: str

    def q(self, sql: str) -> str:
        """Render a statement written with ``?`` placeholders (the shared SQL has no literal ``?``)."""
        return sql if self.placeholder == "?" else sql.replace("?", self.placeholder)

    def ddl(self, template: str) -> str:
        """Render a DDL template's ``{REAL}``, ``{INT}``, ``{TEXT}`` and ``{WITHOUT_ROWID}``."""
        return template.format(**self.types, WITHOUT_ROWID=self.without_rowid)


SQLITE = Dialect("sqlite", "?", {"REAL": "REAL", "INT": "INTEGER", "TEXT": "TEXT"}, " WITHOUT ROWID")
POSTGRES = Dialect("postgresql", "%s", {"REAL": "DOUBLE PRECISION", "INT": "BIGINT", "TEXT": "TEXT"}, "")


@dataclasses.dataclass(frozen=True, slots=True)
class Migration:
    """One step of the schema: the DDL that takes a store from ``version - 1`` to ``version``.

    Migrations are frozen once released: a later change is a new migration, never an edit.
    """

    version: int
    description: str
    statements: tuple[str, ...]


_V1 = Migration(
    1,
    "runs, metrics (long form), events",
    (
        """CREATE TABLE runs (
            id {TEXT} PRIMARY KEY,
            name {TEXT} NOT NULL,
            status {TEXT} NOT NULL,
            started_at {REAL} NOT NULL,
            ended_at {REAL},
            stop_reason {TEXT},
            config {TEXT} NOT NULL,
            world_size {INT} NOT NULL,
            host {TEXT},
            pid {INT},
            python_version {TEXT},
            torch_version {TEXT},
            cuda_version {TEXT},
            cudnn_version {TEXT},
            git_commit {TEXT},
            device {TEXT},
            metric_names {TEXT} NOT NULL,
            environment {TEXT} NOT NULL
        )""",
        "CREATE INDEX runs_by_name ON runs (name, started_at)",
        """CREATE TABLE metrics (
            run_id {TEXT} NOT NULL,
            metric {TEXT} NOT NULL,
            step {INT} NOT NULL,
            rank {INT} NOT NULL,
            epoch {INT} NOT NULL,
            batch {INT} NOT NULL,
            wall_time {REAL} NOT NULL,
            value {REAL},
            PRIMARY KEY (run_id, metric, step, rank)
        ){WITHOUT_ROWID}""",
        """CREATE TABLE events (
            run_id {TEXT} NOT NULL,
            event_key {TEXT} NOT NULL,
            step {INT} NOT NULL,
            rank {INT} NOT NULL,
            kind {TEXT} NOT NULL,
            metric {TEXT},
            raw_value {TEXT},
            message {TEXT} NOT NULL,
            wall_time {REAL} NOT NULL,
            PRIMARY KEY (run_id, event_key)
        )""",
        "CREATE INDEX events_by_step ON events (run_id, step)",
    ),
)

_V2 = Migration(
    2,
    "sparse_metrics: the names a run logged with Tap.log()",
    (
        """CREATE TABLE sparse_metrics (
            run_id {TEXT} NOT NULL,
            metric {TEXT} NOT NULL,
            PRIMARY KEY (run_id, metric)
        ){WITHOUT_ROWID}""",
        # Before version 2, Tap.log() values were stored like step values; they are the only rows
        # with batch -1 (a step's batch is its index in the epoch). A name counts as sparse only
        # when every one of its rows has batch -1.
        """INSERT INTO sparse_metrics (run_id, metric)
            SELECT run_id, metric FROM metrics GROUP BY run_id, metric HAVING MIN(batch) = -1 AND MAX(batch) = -1""",
    ),
)

_V3 = Migration(
    3,
    "histograms: one row per layer, kind and captured step (bt.metrics.Histograms)",
    (
        """CREATE TABLE histograms (
            run_id {TEXT} NOT NULL,
            kind {TEXT} NOT NULL,
            layer {TEXT} NOT NULL,
            step {INT} NOT NULL,
            rank {INT} NOT NULL,
            epoch {INT} NOT NULL,
            batch {INT} NOT NULL,
            wall_time {REAL} NOT NULL,
            low {REAL},
            high {REAL},
            counts {TEXT} NOT NULL,
            PRIMARY KEY (run_id, kind, layer, step, rank)
        ){WITHOUT_ROWID}""",
    ),
)

#: Every migration, in order. ``MIGRATIONS[-1].version`` is what this batchtap writes.
MIGRATIONS: tuple[Migration, ...] = (_V1, _V2, _V3)
#: The schema version this batchtap reads and writes.
SCHEMA_VERSION = MIGRATIONS[-1].version

_VERSION_TABLE = """CREATE TABLE schema_version (
    version {INT} PRIMARY KEY,
    applied_at {REAL} NOT NULL,
    description {TEXT} NOT NULL
)"""
_OWN_TABLES = frozenset({"runs", "metrics", "events", "sparse_metrics", "histograms", "schema_version"})
# Serialises schema creation between processes opening the same PostgreSQL database at once.
_PG_LOCK_KEY = 0x62617463  # "batc"

RUN_COLUMNS = (
    "id", "name", "status", "started_at", "ended_at", "stop_reason", "config", "world_size", "host", "pid",
    "python_version", "torch_version", "cuda_version", "cudnn_version", "git_commit", "device",
    "metric_names", "environment",
)  # fmt: skip
METRIC_COLUMNS = ("run_id", "metric", "step", "rank", "epoch", "batch", "wall_time", "value")
#: values named ``hist/<kind>/<layer>/<min|max|i>`` (bt.metrics.Histograms) are stored as histogram rows
HISTOGRAM_PREFIX = "hist/"
HISTOGRAM_COLUMNS = (
    "run_id", "kind", "layer", "step", "rank", "epoch", "batch", "wall_time", "low", "high", "counts",
)  # fmt: skip
EVENT_COLUMNS = ("run_id", "event_key", "step", "rank", "kind", "metric", "raw_value", "message", "wall_time")


def _insert(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


_METRICS_ON_CONFLICT = (
    " ON CONFLICT (run_id, metric, step, rank) DO UPDATE SET epoch = excluded.epoch,"
    " batch = excluded.batch, wall_time = excluded.wall_time, value = excluded.value"
)
UPSERT_METRICS = _insert("metrics", METRIC_COLUMNS) + _METRICS_ON_CONFLICT
UPSERT_HISTOGRAMS = _insert("histograms", HISTOGRAM_COLUMNS) + (
    " ON CONFLICT (run_id, kind, layer, step, rank) DO UPDATE SET epoch = excluded.epoch,"
    " batch = excluded.batch, wall_time = excluded.wall_time, low = excluded.low, high = excluded.high,"
    " counts = excluded.counts"
)


def upsert_metrics_from(table: str) -> str:
    """The metrics upsert reading its rows from a staging table (PostgreSQL's COPY path).

    The staging table must not hold two rows with the same key (PostgreSQL refuses to update one
    row twice in one statement); :func:`dedupe_metric_rows` ensures it.
    """
    cols = ", ".join(METRIC_COLUMNS)
    return f"INSERT INTO metrics ({cols}) SELECT {cols} FROM {table}" + _METRICS_ON_CONFLICT


def dedupe_metric_rows(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``rows`` with one row per (run, metric, step, rank), the last one winning, as the
    row-by-row upsert would leave it. Returns ``rows`` itself when it has no duplicate (the norm).

    Example:
        >>> dedupe_metric_rows([("r", "m", 1, 0, 0, 1, 0.0, 1.0), ("r", "m", 1, 0, 0, 1, 0.0, 2.0)])
        [('r', 'm', 1, 0, 0, 1, 0.0, 2.0)]
    """
    keys = {row[:4] for row in rows}
    if len(keys) == len(rows):
        return rows
    last = {row[:4]: row for row in rows}
    return list(last.values())


INSERT_EVENTS = _insert("events", EVENT_COLUMNS) + " ON CONFLICT (run_id, event_key) DO NOTHING"
INSERT_SPARSE = _insert("sparse_metrics", ("run_id", "metric")) + " ON CONFLICT (run_id, metric) DO NOTHING"
#: The largest step of a run's step values (its Tap.log() values left out: they may name any step);
#: parameters (run_id, run_id). What a resumed run continues after.
LAST_STEP = (
    "SELECT MAX(step) FROM metrics WHERE run_id = ?"
    " AND metric NOT IN (SELECT metric FROM sparse_metrics WHERE run_id = ?)"
)
# start_run and end_run both send the whole row; the earliest start time wins so that a
# placeholder row (see ENSURE_RUN) or a resumed run keeps when the run really began.
UPSERT_RUN = (
    _insert("runs", RUN_COLUMNS)
    + " ON CONFLICT (id) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in RUN_COLUMNS if c not in ("id", "started_at"))
    + ", started_at = CASE WHEN excluded.started_at < runs.started_at"
    " THEN excluded.started_at ELSE runs.started_at END"
)
# Records whose run never had start_run (a sink attached mid-run) still get a runs row.
ENSURE_RUN = (
    "INSERT INTO runs (id, name, status, started_at, config, world_size, metric_names, environment)"
    " VALUES (?, ?, 'running', ?, '{}', 1, '[]', '{}') ON CONFLICT (id) DO NOTHING"
)


def float_to_text(x: float | None) -> str | None:
    """Exact text of a float by the record codec's rule (:func:`batchtap.records.format_float`:
    ``repr``, NaN and infinities as ``"nan"``, ``"inf"``, ``"-inf"``); ``None`` stays ``None``.

    Example:
        >>> float_to_text(float("nan")), float_to_text(0.1), text_to_float("-inf")
        ('nan', '0.1', -inf)
    """
    return None if x is None else format_float(x)


def text_to_float(s: str | None) -> float | None:
    """Inverse of :func:`float_to_text`."""
    return None if s is None else parse_float(s)


def metric_rows(records: Sequence[Record]) -> list[tuple[Any, ...]]:
    """Long-form rows of a block of records, in :data:`METRIC_COLUMNS` order (NaN -> ``None``).

    Example:
        >>> r = Record("r1", step=2, epoch=0, batch=2, rank=0, wall_time=1.5, values={"loss": float("nan")})
        >>> metric_rows([r])
        [('r1', 'loss', 2, 0, 0, 2, 1.5, None)]
    """
    rows: list[tuple[Any, ...]] = []
    append = rows.append
    for r in records:
        run_id, step, rank, epoch, batch, wall = r.run_id, r.step, r.rank, r.epoch, r.batch, r.wall_time
        for name, value in r.values.items():
            if name.startswith(HISTOGRAM_PREFIX) and _histogram_part(name) is not None:
                continue  # stored compactly: histogram_rows
            v = float(value)
            append((run_id, name, step, rank, epoch, batch, wall, None if v != v else v))
    return rows


def _histogram_part(name: str) -> tuple[str, str, str] | None:
    """``(kind, layer, part)`` of a histogram value's name ``hist/<kind>/<layer>/<min|max|i>``;
    None for any other name under ``hist/`` (a user's own value, stored as usual).

    Example:
        >>> _histogram_part("hist/grad/blocks.0/12"), _histogram_part("hist/my_value")
        (('grad', 'blocks.0', '12'), None)
    """
    kind, _, rest = name[len(HISTOGRAM_PREFIX) :].partition("/")
    layer, _, part = rest.rpartition("/")
    if not kind or not layer or not (part in ("min", "max") or part.isdigit()):
        return None
    return kind, layer, part


def histogram_rows(records: Sequence[Record]) -> list[tuple[Any, ...]]:
    """One row per layer, kind and record of the ``hist/<kind>/<layer>/<part>`` values, in
    :data:`HISTOGRAM_COLUMNS` order: the counts as a JSON list, bin ``i`` at index ``i``.

    Example:
        >>> v = {"loss": 1.0, "hist/grad/fc/min": -1.0, "hist/grad/fc/max": 1.0, "hist/grad/fc/1": 3.0, "hist/grad/fc/0": 2.0}
        >>> histogram_rows([Record("r1", step=4, epoch=0, batch=4, rank=0, wall_time=1.5, values=v)])
        [('r1', 'grad', 'fc', 4, 0, 0, 4, 1.5, -1.0, 1.0, '[2.0,3.0]')]
    """
    rows: list[tuple[Any, ...]] = []
    for r in records:
        parts: dict[tuple[str, str], dict[str, float]] = {}
        for name, value in r.values.items():
            if name.startswith(HISTOGRAM_PREFIX):
                found = _histogram_part(name)
                if found is not None:
                    parts.setdefault(found[:2], {})[found[2]] = float(value)
        for (kind, layer), got in parts.items():
            low, high = got.pop("min", math.nan), got.pop("max", math.nan)
            counts = [got[k] for k in sorted(got, key=int)]
            rows.append(
                (
                    r.run_id, kind, layer, r.step, r.rank, r.epoch, r.batch, r.wall_time,
                    None if low != low else low, None if high != high else high,
                    json.dumps(counts, separators=(",", ":")),
                )
            )  # fmt: skip
    return rows


def sparse_rows(records: Sequence[Record]) -> list[tuple[str, str]]:
    """``(run_id, metric)`` of each name the sparse records of a block carry, once each
    (:data:`INSERT_SPARSE`); empty for a block of step records only.

    Example:
        >>> r = Record("r1", step=9, epoch=0, batch=-1, rank=0, wall_time=1.5, values={"val_loss": 0.3}, sparse=True)
        >>> sparse_rows([r, r])
        [('r1', 'val_loss')]
    """
    seen: dict[tuple[str, str], None] = {}
    for r in records:
        if r.sparse:
            for name in r.values:
                seen[(r.run_id, name)] = None
    return list(seen)


def _event_key(e: Event) -> str:
    # repr(wall_time) as since schema 1: the keys of events already stored must not change.
    payload = json.dumps(
        [e.step, e.rank, e.kind.value, e.metric, float_to_text(e.raw_value), e.message, repr(e.wall_time)],
        ensure_ascii=True,
    )
    return hashlib.sha1(payload.encode(), usedforsecurity=False).hexdigest()


def event_rows(events: Sequence[Event]) -> list[tuple[Any, ...]]:
    """Rows of events in :data:`EVENT_COLUMNS` order; equal events get equal keys."""
    return [
        (
            e.run_id,
            _event_key(e),
            e.step,
            e.rank,
            e.kind.value,
            e.metric,
            float_to_text(e.raw_value),
            e.message,
            e.wall_time,
        )
        for e in events
    ]


# RunInfo.environment keys accepted for each column (first present wins).
_ENV_COLUMNS: dict[str, tuple[str, ...]] = {
    "host": ("host", "hostname"),
    "pid": ("pid",),
    "python_version": ("python", "python_version"),
    "torch_version": ("torch", "torch_version"),
    "cuda_version": ("cuda", "cuda_version"),
    "cudnn_version": ("cudnn", "cudnn_version"),
    "git_commit": ("git_commit", "git"),
    "device": ("device",),
}


def _env(environment: Mapping[str, Any], column: str) -> Any:
    for key in _ENV_COLUMNS[column]:
        value = environment.get(key)
        if value is not None:
            if column == "pid":
                return int(value)
            return str(value)
    return None


def run_row(run: RunInfo) -> tuple[Any, ...]:
    """The ``runs`` row of a :class:`RunInfo`, in :data:`RUN_COLUMNS` order."""
    env = run.environment
    return (
        run.id,
        run.name,
        run.status.value,
        run.started_at,
        run.ended_at,
        run.stop_reason,
        json.dumps(run.config, default=str),
        run.world_size,
        *(_env(env, c) for c in _ENV_COLUMNS),
        json.dumps(list(run.metrics)),
        json.dumps(env, default=str),
    )


def run_rows_for_records(records: Sequence[Record]) -> list[tuple[str, str, float]]:
    """Placeholder ``runs`` rows (:data:`ENSURE_RUN`) for the runs a block of records belongs to."""
    first: dict[str, float] = {}
    for r in records:
        first.setdefault(r.run_id, r.wall_time)
    return [(run_id, run_id, wall) for run_id, wall in first.items()]


@contextlib.contextmanager
def transaction(conn: Any, dialect: Dialect) -> Iterator[None]:
    """One transaction on a sqlite3 connection (opened with ``isolation_level=None``) or a psycopg
    connection (``autocommit=True``). SQLite takes the write lock at once (``BEGIN IMMEDIATE``) so
    that two writers queue on ``busy_timeout`` instead of failing half-way."""
    if dialect.name == "postgresql":
        with conn.transaction():
            yield
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        # SQLite may already have rolled back (e.g. disk full); a second ROLLBACK would raise.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _tables(conn: Any, dialect: Dialect) -> set[str]:
    if dialect.name == "sqlite":
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    else:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
        ).fetchall()
    return {r[0] for r in rows}


def _current_version(conn: Any, dialect: Dialect, where: str) -> int | None:
    """The store's schema version, ``None`` when it has no tables at all."""
    tables = _tables(conn, dialect)
    if "schema_version" in tables:
        row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        return int(row[0]) if row and row[0] is not None else 0
    # An empty PostgreSQL schema may hold other applications' tables; only clashing names matter.
    # A SQLite file with any table at all belongs to something else.
    foreign = tables & _OWN_TABLES if dialect.name == "postgresql" else tables
    if foreign:
        raise StoreError(
            f"{where} is not a batchtap store: it has tables {sorted(foreign)} but no schema_version "
            "table; expected an empty database or one written by batchtap; fix: point batchtap at a "
            "new file or database (or another PostgreSQL schema)"
        )
    return None


def ensure_schema(conn: Any, dialect: Dialect, *, where: str, create: bool = True) -> int:
    """Check a store's schema version and apply the migrations it lacks.

    Args:
        conn: an open sqlite3 (``isolation_level=None``) or psycopg (``autocommit=True``) connection.
        dialect: :data:`SQLITE` or :data:`POSTGRES`.
        where: the store's location as shown in errors (never with a password).
        create: create the schema in an empty store; when False an empty store is an error
            (readers do not create stores).

    Returns:
        The schema version after migration, always :data:`SCHEMA_VERSION`.

    Raises:
        StoreError: the store belongs to something else, was written by a newer batchtap, or is
            empty while ``create`` is False.
    """
    version = _current_version(conn, dialect, where)
    if version == SCHEMA_VERSION:
        return version  # the common case: no lock, no write
    _check_not_newer(version, where)
    if version is None and not create:
        raise StoreError(
            f"{where} is empty, not a batchtap store; expected a store written by bt.sinks.SQLite or "
            "bt.sinks.Postgres; fix: check the path or URL"
        )
    with transaction(conn, dialect):
        if dialect.name == "postgresql":
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_LOCK_KEY,))
        # Re-read under the lock: another process may have created or migrated it meanwhile.
        version = _current_version(conn, dialect, where)
        _check_not_newer(version, where)
        if version is None:
            conn.execute(dialect.ddl(_VERSION_TABLE))
            version = 0
        for migration in MIGRATIONS:
            if migration.version <= version:
                continue
            for statement in migration.statements:
                conn.execute(dialect.ddl(statement))
            conn.execute(
                dialect.q("INSERT INTO schema_version (version, applied_at, description) VALUES (?, ?, ?)"),
                (migration.version, time.time(), migration.description),
            )
    return SCHEMA_VERSION


def _check_not_newer(version: int | None, where: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise StoreError(
            f"{where} has schema version {version}, but this batchtap knows versions up to "
            f"{SCHEMA_VERSION}; it was written by a newer batchtap; fix: upgrade batchtap "
            "(pip install -U batchtap) or use another store"
        )
