"""Read-only reads of a store for the browser view: runs, decimated series, events, live tails.

The store is opened read-only whatever its engine (SQLite ``mode=ro``; PostgreSQL with
``default_transaction_read_only``), so the UI cannot write to it even by mistake; a store that
would need a migration is refused instead of migrated. Every query takes its values as parameters:
nothing that arrives in a request reaches SQL as text.

A series is sent as it is when the asked step range holds at most two points per pixel, else
decimated to ``width`` buckets of equal step span, each kept as its minimum and its maximum (so a
one-step spike survives any zoom level) and its mean (what the smoothed line follows). The
buckets are aggregated by the database, and the lines of runs that have ended are kept in memory
(:mod:`batchtap.ui.decimate`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchtap._optional import require
from batchtap.store.errors import StoreError
from batchtap.store.schema import POSTGRES, SCHEMA_VERSION, SQLITE, Dialect
from batchtap.store.url import parse_url, redact_dsn, redact_message
from batchtap.ui.decimate import (
    POSTGRES_BUCKETS,
    SQLITE_BUCKETS,
    SQLITE_ONE_BUCKET,
    Bucket,
    LineCache,
    needs_exact_read,
    parse_sqlite_bucket,
)

__all__ = ["ReadOnlyStore", "MAX_WIDTH", "MIN_WIDTH", "clean", "best_is_max"]

#: Bounds on the number of buckets a request may ask for (the chart's width in pixels).
MIN_WIDTH = 10
MAX_WIDTH = 4000
#: Raw points are sent while a range holds at most this many points per bucket.
RAW_PER_BUCKET = 2
#: How much of a SQLite store each reading connection maps into memory.
MMAP_BYTES = 1 << 30
#: Events sent for one run at most (the newest are dropped past it, and the page says so).
MAX_EVENTS = 20_000


def clean(x: Any) -> float | None:
    """A value as JSON can carry it: NaN, infinities and SQL NULL become ``None``.

    Example:
        >>> clean(0.5), clean(float("nan")), clean(None)
        (0.5, None, None)
    """
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def best_is_max(metric: str) -> bool:
    """Whether larger is better for a metric, judged by its name (accuracy-like, throughput).

    Example:
        >>> best_is_max("val_acc"), best_is_max("loss")
        (True, False)
    """
    name = metric.lower()
    return any(k in name for k in ("acc", "throughput", "f1", "precision", "recall", "auc"))


@dataclasses.dataclass(frozen=True, slots=True)
class SeriesKey:
    """Which stored rows make one line: a run's metric at one rank (``-1``: reduced over ranks)."""

    run_id: str
    metric: str
    rank: int


class ReadOnlyStore:
    """Read-only access to a store from the server's threads: a SQLite connection per thread, or
    one PostgreSQL connection taken in turn.

    Args:
        url: SQLite path, ``sqlite:///path`` or ``postgresql://...``.
        schema: PostgreSQL schema holding the tables (``None``: the server's ``search_path``).

    Raises:
        StoreError: missing, unreachable, not a batchtap store, or at another schema version.
    """

    def __init__(self, url: str | os.PathLike[str], *, schema: str | None = None) -> None:
        loc = parse_url(url)
        self.where = loc.display()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._opened: list[Any] = []
        self._path = Path(loc.target)
        self._shared: Any = None
        #: Decimated lines of runs that have ended, kept between requests (see :class:`LineCache`).
        self.lines = LineCache()
        if loc.kind == "sqlite":
            self.dialect: Dialect = SQLITE
            self._conn()  # open one now: a bad path fails here, not at the first request
        else:
            self.dialect = POSTGRES
            self._shared = _open_postgres(loc.target, schema, self.where)
            self._opened.append(self._shared)
            if schema is not None:
                self.where = f"{self.where} (schema {schema!r})"
        try:
            _check_version(self, self.where)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close every connection opened."""
        with self._lock:
            for conn in self._opened:
                conn.close()
            self._opened.clear()

    def _conn(self) -> Any:
        """This thread's SQLite connection (the server's threads read in parallel), or the one
        PostgreSQL connection."""
        if self._shared is not None:
            return self._shared
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = _open_sqlite(self._path, self.where)
            with self._lock:
                self._opened.append(conn)
        return conn

    def _all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        conn = self._conn()
        if self._shared is None:
            return list(conn.execute(self.dialect.q(sql), tuple(params)).fetchall())
        with self._lock:  # psycopg serialises a connection's queries; keep whole reads together
            return list(conn.execute(self.dialect.q(sql), tuple(params)).fetchall())

    def _one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = self._all(sql, params)
        return rows[0] if rows else None

    # -- runs ------------------------------------------------------------------------------
    def runs(self) -> list[dict[str, Any]]:
        """Every run, newest first, with its summary (see :meth:`summary`)."""
        rows = self._all(f"SELECT {_RUN_FIELDS} FROM runs ORDER BY started_at DESC, id")
        return [self.summary(_run_dict(r)) for r in rows]

    def run(self, run_id: str) -> dict[str, Any] | None:
        """One run by exact id, with its summary (no step count), metric names, sparse names and ranks; ``None``
        when there is no such run."""
        row = self._one(f"SELECT {_RUN_FIELDS} FROM runs WHERE id = ?", (run_id,))
        if row is None:
            return None
        run = self.summary(_run_dict(row), counts=False)  # a run page needs no scan of its rows
        names = self.metric_names(run_id)
        run["metrics"] = names
        run["sparse"] = [
            r[0] for r in self._all("SELECT metric FROM sparse_metrics WHERE run_id = ? ORDER BY metric", (run_id,))
        ]
        run["ranks"] = {m: self.ranks(run_id, m) for m in names}
        return run

    def status(self, run_id: str) -> tuple[str, float | None, str | None] | None:
        """A run's status, end time and stop reason (``None``: no such run)."""
        row = self._one("SELECT status, ended_at, stop_reason FROM runs WHERE id = ?", (run_id,))
        return None if row is None else (str(row[0]), None if row[1] is None else float(row[1]), row[2])

    def summary(self, run: dict[str, Any], *, counts: bool = True) -> dict[str, Any]:
        """Add steps, last step, last and best values of the main metric (``loss`` when the run
        has it, else its first declared metric) and the anomaly count to a run's fields.
        ``counts=False`` leaves out the steps and the best value (a scan of the metric's rows)."""
        declared = [m for m in run["declared"] if m != "loss"]
        main = None
        for name in ["loss", *declared]:
            if self._first_rank(run["id"], name) is not None:
                main = name
                break
        run.update(main=main, steps=0, last_step=None, last_value=None, best_value=None, last_wall=None)
        if main is not None:
            key = SeriesKey(run["id"], main, self._first_rank(run["id"], main) or 0)
            agg = "MAX" if best_is_max(main) else "MIN"
            count, best = (None, None)
            if counts:
                count, best = self._one(
                    f"SELECT COUNT(*), {agg}(value) FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?",
                    (key.run_id, key.metric, key.rank),
                ) or (0, None)
            last = self._one(
                "SELECT step, value, wall_time FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?"
                " ORDER BY step DESC LIMIT 1",
                (key.run_id, key.metric, key.rank),
            )
            run.update(steps=None if count is None else int(count), best_value=clean(best))
            if last is not None:
                run.update(last_step=int(last[0]), last_value=clean(last[1]), last_wall=float(last[2]))
        kinds = self._all("SELECT kind, COUNT(*) FROM events WHERE run_id = ? GROUP BY kind", (run["id"],))
        run["events"] = {str(k): int(n) for k, n in kinds}
        run["anomalies"] = run["events"].get("anomaly", 0)
        end = run["ended_at"] if run["ended_at"] is not None else run["last_wall"]
        run["duration"] = None if end is None else max(0.0, end - run["started_at"])
        return run

    def metric_names(self, run_id: str) -> list[str]:
        """Names with stored values: declared ones in their order, then the others sorted."""
        # A skip scan over the primary key's (run_id, metric) prefix: one probe per name.
        rows = self._all(
            "WITH RECURSIVE m(name) AS (SELECT MIN(metric) FROM metrics WHERE run_id = ?"
            " UNION ALL SELECT (SELECT MIN(metric) FROM metrics WHERE run_id = ? AND metric > m.name)"
            " FROM m WHERE m.name IS NOT NULL) SELECT name FROM m WHERE name IS NOT NULL",
            (run_id, run_id),
        )
        present = [r[0] for r in rows]
        declared = self._one("SELECT metric_names FROM runs WHERE id = ?", (run_id,))
        order = [m for m in (json.loads(declared[0]) if declared and declared[0] else []) if m in present]
        return order + sorted(set(present) - set(order))

    def _first_rank(self, run_id: str, metric: str) -> int | None:
        # The reduced rows (rank -1) exist at every step when a run has them, so the smallest rank
        # at the first step is the series to show: found through the key, without a scan.
        row = self._one(
            "SELECT rank FROM metrics WHERE run_id = ? AND metric = ? ORDER BY step, rank LIMIT 1", (run_id, metric)
        )
        return None if row is None else int(row[0])

    def ranks(self, run_id: str, metric: str) -> list[int]:
        """The ranks stored for a metric at its first step (``-1``: the reduced rows)."""
        first = self._one("SELECT MIN(step) FROM metrics WHERE run_id = ? AND metric = ?", (run_id, metric))
        if first is None or first[0] is None:
            return []
        rows = self._all(
            "SELECT rank FROM metrics WHERE run_id = ? AND metric = ? AND step = ? ORDER BY rank",
            (run_id, metric, first[0]),
        )
        return [int(r[0]) for r in rows]

    # -- series ----------------------------------------------------------------------------
    def series(
        self,
        run_id: str,
        metric: str,
        *,
        rank: int | None = None,
        start: int | None = None,
        end: int | None = None,
        width: int = 1000,
    ) -> dict[str, Any]:
        """One line of a chart over steps ``[start, end]`` (default: all), columnar.

        Returns:
            ``mode`` (``"raw"`` or ``"minmax"``), ``rank``, and equal-length lists ``step``,
            ``value`` and ``wall``; when decimated also ``mean`` (the bucket's mean) and ``lo``/``hi``
            (the steps the point stands for); ``bucket`` (steps per bucket).
        """
        width = max(MIN_WIDTH, min(MAX_WIDTH, int(width)))
        if rank is None:
            rank = self._first_rank(run_id, metric)
            if rank is None:
                return _columns("raw", 0, [], 1)
        lo = -(2**62) if start is None else int(start)
        hi = 2**62 if end is None else int(end)
        limit = RAW_PER_BUCKET * width
        rows = self._all(
            "SELECT step, value, wall_time FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?"
            " AND step >= ? AND step <= ? ORDER BY step LIMIT ?",
            (run_id, metric, rank, lo, hi, limit + 1),
        )
        if len(rows) <= limit:
            return _columns("raw", rank, rows, 1)
        last = self._one(
            "SELECT step FROM metrics WHERE run_id = ? AND metric = ? AND rank = ? AND step <= ?"
            " ORDER BY step DESC LIMIT 1",
            (run_id, metric, rank, hi),
        )
        first_step, last_step = int(rows[0][0]), int(last[0]) if last else int(rows[-1][0])
        bucket = max(1, math.ceil((last_step - first_step + 1) / width))
        key = SeriesKey(run_id, metric, rank)
        # A run that is not running has rows that no longer change: its lines are kept in memory
        # (the status and end time are part of the key, so a resumed run is read again).
        now = self.status(run_id)
        cacheable = now is not None and now[0] != "running"
        return self.lines.get(
            (key, first_step, last_step, bucket, now),
            lambda: _minmax_columns(rank, self.buckets(key, first_step, last_step, bucket), bucket, last_step),
            keep=cacheable,
        )

    def buckets(self, key: SeriesKey, first: int, last: int, bucket: int) -> list[Bucket]:
        """A line's steps ``[first, last]`` cut into buckets of ``bucket`` steps, aggregated in the
        database (see :mod:`batchtap.ui.decimate`): (bucket's first step, min, max, mean, wall time
        of its first row) for each bucket that has a value, in step order."""
        if self.dialect is not SQLITE:
            rows = self._all(
                POSTGRES_BUCKETS, (first, bucket, float(bucket), key.run_id, key.metric, key.rank, first, last)
            )
            return [
                (first + int(b) * bucket, float(lo), float(hi), float(part) * (bucket / int(count)), float(wall))
                for b, lo, hi, part, count, wall in rows
                if lo is not None
            ]
        rows = self._all(SQLITE_BUCKETS, (first, bucket, last, key.run_id, key.metric, key.rank))
        out: list[Bucket] = []
        for b0, text, wall in rows:
            got = parse_sqlite_bucket(text)
            if got is None:
                continue
            if needs_exact_read(got):
                exact = self._one(SQLITE_ONE_BUCKET, (key.run_id, key.metric, key.rank, b0, min(b0 + bucket - 1, last)))
                got = (float(exact[0]), float(exact[1]), float(exact[2])) if exact else got
            out.append((int(b0), *got, float(wall)))
        return out

    def after(self, run_id: str, metric: str, rank: int, step: int, limit: int = 50_000) -> dict[str, Any]:
        """Raw points of one line past ``step`` (what a live chart appends), at most ``limit``."""
        rows = self._all(
            "SELECT step, value, wall_time FROM metrics WHERE run_id = ? AND metric = ? AND rank = ? AND step > ?"
            " ORDER BY step LIMIT ?",
            (run_id, metric, rank, step, limit),
        )
        return _columns("raw", rank, rows, 1)

    def rank_spread(self, run_id: str, metric: str, *, width: int = 1000) -> dict[str, Any]:
        """Per step, over the ranks' own rows (``per_rank_rows``): the slowest (largest) rank, the
        largest and smallest value and their spread; bucketed to ``width`` by the step's largest
        spread, so a straggler step is never averaged away."""
        import numpy as np

        rows = self._all(
            "SELECT step, rank, value FROM metrics WHERE run_id = ? AND metric = ? AND rank >= 0 ORDER BY step, rank",
            (run_id, metric),
        )
        if not rows:
            return {"step": [], "max": [], "min": [], "spread": [], "slowest": [], "ranks": []}
        arr = np.array([(s, r, np.nan if v is None else v) for s, r, v in rows], dtype=float)
        steps, index = np.unique(arr[:, 0], return_inverse=True)
        ranks = np.unique(arr[:, 1]).astype(int)
        grid = np.full((len(steps), len(ranks)), np.nan)
        grid[index, np.searchsorted(ranks, arr[:, 1].astype(int))] = arr[:, 2]
        with np.errstate(all="ignore"):
            high = np.nanmax(np.where(np.isnan(grid), -np.inf, grid), axis=1)
            low = np.nanmin(np.where(np.isnan(grid), np.inf, grid), axis=1)
        slowest = ranks[np.argmax(np.where(np.isnan(grid), -np.inf, grid), axis=1)]
        spread = high - low
        keep = np.arange(len(steps))
        width = max(MIN_WIDTH, min(MAX_WIDTH, int(width)))
        if len(steps) > RAW_PER_BUCKET * width:
            # one step per bucket: the one with the largest spread
            edges = np.linspace(0, len(steps), width + 1).astype(int)
            keep = np.array(
                [a + int(np.nanargmax(np.nan_to_num(spread[a:b], nan=-1))) for a, b in zip(edges, edges[1:]) if b > a]
            )
        return {
            "step": [int(s) for s in steps[keep]],
            "max": [clean(v) for v in high[keep]],
            "min": [clean(v) for v in low[keep]],
            "spread": [clean(v) for v in spread[keep]],
            "slowest": [int(r) for r in slowest[keep]],
            "ranks": [int(r) for r in ranks],
        }

    # -- events ----------------------------------------------------------------------------
    def events(self, run_id: str) -> list[dict[str, Any]]:
        """A run's events in step order (at most :data:`MAX_EVENTS`)."""
        rows = self._all(
            "SELECT step, rank, kind, metric, raw_value, message, wall_time FROM events WHERE run_id = ?"
            " ORDER BY step, wall_time, event_key LIMIT ?",
            (run_id, MAX_EVENTS),
        )
        return [
            {
                "step": int(s),
                "rank": int(r),
                "kind": str(k),
                "metric": m,
                "raw": raw,
                "message": str(msg),
                "wall": float(w),
            }
            for s, r, k, m, raw, msg, w in rows
        ]

    def event_count(self, run_id: str) -> int:
        """How many events a run has."""
        row = self._one("SELECT COUNT(*) FROM events WHERE run_id = ?", (run_id,))
        return int(row[0]) if row else 0

    def value_at(self, run_id: str, metric: str, rank: int, step: int) -> float | None:
        """The latest finite value of a line at or before ``step`` (where an event marker sits)."""
        row = self._one(
            "SELECT value FROM metrics WHERE run_id = ? AND metric = ? AND rank = ? AND step <= ?"
            " AND value IS NOT NULL ORDER BY step DESC LIMIT 1",
            (run_id, metric, rank, step),
        )
        return None if row is None else clean(row[0])


_RUN_FIELDS = "id, name, status, started_at, ended_at, stop_reason, config, world_size, environment, metric_names"


def _run_dict(row: tuple[Any, ...]) -> dict[str, Any]:
    rid, name, status, started, ended, reason, config, world, env, metrics = row
    return {
        "id": str(rid),
        "name": str(name),
        "status": str(status),
        "started_at": float(started),
        "ended_at": None if ended is None else float(ended),
        "stop_reason": reason,
        "config": _json_object(config),
        "world_size": int(world),
        "environment": _json_object(env),
        "declared": list(json.loads(metrics)) if metrics else [],
    }


def _json_object(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _columns(mode: str, rank: int, rows: Sequence[tuple[Any, ...]], bucket: int) -> dict[str, Any]:
    """Points of (step, value, wall[, lo, hi, mean]) as the columns a chart's data source takes.
    Raw points have no ``lo``, ``hi`` and ``mean`` (the step and the value themselves): fewer bytes."""
    out: dict[str, Any] = {
        "mode": mode,
        "rank": rank,
        "bucket": bucket,
        "step": [int(r[0]) for r in rows],
        "value": [clean(r[1]) for r in rows],
        "wall": [round(float(r[2]), 3) for r in rows],
    }
    if mode != "raw":
        out.update(lo=[int(r[3]) for r in rows], hi=[int(r[4]) for r in rows], mean=[clean(r[5]) for r in rows])
    return out


def _minmax_columns(rank: int, buckets: Sequence[Bucket], bucket: int, last_step: int) -> dict[str, Any]:
    """Each bucket as two points, its minimum at its first step and its maximum at its last (a
    bucket is at most a pixel wide, so where inside it they fall does not show); both carry the
    bucket's step span, mean and the wall time of its first row. A bucket of NaN values only has
    no point (the buckets leave it out): the anomaly markers show its steps."""
    rows = []
    for b0, low, high, mean, wall in buckets:
        b1 = min(b0 + bucket - 1, last_step)
        rows += [(b0, low, wall, b0, b1, mean), (b1, high, wall, b0, b1, mean)]
    return _columns("minmax", rank, rows, bucket)


def _open_sqlite(path: Path, where: str) -> sqlite3.Connection:
    if not path.is_file():
        raise StoreError(
            f"no batchtap store at {where}: the file does not exist; expected a SQLite file written by "
            "bt.sinks.SQLite; fix: check the path (or run `batchtap demo` to make runs/batchtap.db)"
        )
    # mode=ro: SQLite refuses every write on this connection; the UI never creates, migrates or
    # changes the journal mode of a store, and reads beside a training process writing it (WAL).
    uri = path.resolve().as_uri() + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None, timeout=10.0)
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        # Read pages through a memory map instead of a read() call per 4 kB page: a decimation
        # scans every row of a line (~30% faster here). Address space only; SQLite maps no more
        # than the file holds and never writes through a read-only connection's map.
        conn.execute(f"PRAGMA mmap_size = {MMAP_BYTES}")
    except sqlite3.Error as exc:
        raise StoreError(
            f"cannot read SQLite store {where}: {exc}; expected a readable SQLite file (and its -wal/-shm "
            "files, or a writable directory for them); fix: check the path and its permissions"
        ) from None
    return conn


def _open_postgres(dsn: str, schema: str | None, where: str) -> Any:
    psycopg = require("psycopg", extra="postgres", purpose="batchtap ui on PostgreSQL")
    try:
        conn = psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=5,
            application_name="batchtap-ui",
            # Every transaction of this session is read-only: the server refuses any write.
            options="-c default_transaction_read_only=on",
        )
    except psycopg.Error as exc:
        reason = redact_message(str(exc).strip().replace("\n", " "), dsn)
        raise StoreError(
            f"cannot connect to PostgreSQL at {redact_dsn(dsn)}: {reason}; expected a reachable server "
            "accepting this user and database; fix: check host, port, user, database and that it is running"
        ) from None
    if schema is not None:
        sql = require("psycopg.sql", extra="postgres", purpose="batchtap ui on PostgreSQL")
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
    return conn


def _check_version(store: ReadOnlyStore, where: str) -> None:
    if store.dialect is SQLITE:
        tables = {r[0] for r in store._all("SELECT name FROM sqlite_master WHERE type = 'table'")}
    else:
        tables = {
            r[0]
            for r in store._all(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
            )
        }
    if "schema_version" not in tables:
        raise StoreError(
            f"{where} is not a batchtap store (no schema_version table); expected a store written by "
            "bt.sinks.SQLite or bt.sinks.Postgres; fix: check the path or URL (and --schema)"
        )
    row = store._one("SELECT MAX(version) FROM schema_version")
    version = int(row[0]) if row and row[0] is not None else 0
    if version < SCHEMA_VERSION:
        raise StoreError(
            f"{where} has schema version {version}, older than this batchtap's {SCHEMA_VERSION}; the UI opens "
            "stores read-only and does not migrate them; fix: run `batchtap runs --db ...` once (it migrates), "
            "then start the UI again"
        )
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{where} has schema version {version}, but this batchtap knows versions up to {SCHEMA_VERSION}; "
            "fix: upgrade batchtap (pip install -U batchtap)"
        )
