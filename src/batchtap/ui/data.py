"""The browser view's JSON over the one store reader (:class:`batchtap.store.Store`).

The store is opened read-only whatever its engine (``batchtap.store.open(url, migrate=False)``:
SQLite ``mode=ro``; PostgreSQL with ``default_transaction_read_only``), so the UI cannot write to
it even by mistake; a store that would need a migration is refused instead of migrated. Its
connections are a bounded pool shared by the server's threads, closed when idle. Status (with the
derived ``killed``), steps, best and last values come from the reader, so the UI, ``batchtap show``
/ ``runs`` and ``Store.frame()`` agree; best values are taken on the kept trajectory (steps a
rollback undid are left out). Every query takes its values as parameters: nothing that arrives in
a request reaches SQL as text (the runs filter is parsed and matched in Python,
:mod:`batchtap.store.runquery`).

A series is sent as it is when the asked step range holds at most two points per pixel, else
decimated to ``width`` buckets of equal step span, each kept as its minimum and its maximum (so a
one-step spike survives any zoom level) and its mean (what the smoothed line follows). The
buckets are aggregated by the database, and the lines of runs that have ended are kept in memory
(:mod:`batchtap.ui.decimate`).

JSON endpoints (for the page's scripts; every value that JSON cannot carry, NaN or inf, is ``null``):

* ``GET /api/runs?q=QUERY`` -> ``{"store", "now", "query", "runs": [RUN, ...]}``, newest first. ``q``
  is optional: a filter such as ``lr<0.01 and status=finished`` (see :mod:`batchtap.store.runquery`;
  fields ``id name status steps best last duration anomalies tag notes``, else config keys). A query
  that does not parse, or names a key no run has, is ``400 {"error": ...}``. ``now`` is the server's
  ``time.time()`` (a running run's duration grows from ``started_at`` to it).
* RUN (a runs-table row): ``id``, ``short_id`` (8 characters), ``name``, ``status`` (``running``,
  ``finished``, ``failed``, ``stopped``, ``killed``), ``started_at``, ``ended_at``, ``stop_reason``,
  ``config`` (an object: the parsed arguments under ``batchtap run``), ``world_size``,
  ``environment``, ``declared`` (declared metric names), ``tags`` (list of str), ``notes`` (str or
  null), ``main`` (the metric judged: ``loss`` when present), ``higher_is_better``, ``steps`` (distinct
  steps stored), ``last_step``, ``last_value``, ``best_value``, ``min_value``, ``max_value`` (best/min/max
  on the kept trajectory), ``last_wall``, ``duration`` (seconds; to the last stored value while
  running), ``rolled_back`` (``[[first, last], ...]`` undone steps), ``events`` (count per kind),
  ``anomalies``.
* ``GET /api/runs/live?q=QUERY`` -> server-sent events, each ``event: runs`` with data
  ``{"first": bool, "now": float, "runs": [RUN, ...], "removed": [id, ...]}``. The first message
  (``first: true``) has every matching run; then, at most once a second and only when something
  changed, the runs that are new or moved (status, end, last step; a running run every second, its
  duration grows) and the ids of runs gone (deleted, or no longer matching ``q``). The page merges
  them by ``id``. A bad ``q`` is ``400`` before the stream starts.
* ``GET /api/runs/{id}`` — one RUN plus ``metrics``, ``sparse`` and ``ranks`` (per metric). ``{id}``
  (here and below) is a full id, a unique id prefix (the 8-character short id) or a run name (the
  latest run of it); ``404 {"error"}`` when none matches, naming the closest.
* ``GET /api/runs/{id}/series?metric=&rank=&start=&end=&width=`` — one line (see :meth:`ReadOnlyStore.series`).
* ``GET /api/runs/{id}/events``, ``/ranks?metric=``, ``/live?after=&events=`` — as before.
* ``GET /api/runs/{id}/epochs`` -> ``{"epochs": [[epoch, first_step, last_step], ...]}`` in step
  order, from the main metric's rows (the x axis by epoch; see :meth:`ReadOnlyStore.epochs`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from batchtap.store import runquery
from batchtap.store.errors import RunNotFound
from batchtap.store.reader import Store
from batchtap.store.rows import MetricSummary, RunRow, best_is_max, json_object, status_of
from batchtap.store.schema import SQLITE, Dialect
from batchtap.ui.decimate import (
    CACHE_POINTS,
    POSTGRES_BUCKETS,
    SQLITE_BUCKETS,
    SQLITE_ONE_BUCKET,
    Bucket,
    LineCache,
    clean,
    columns,
    minmax_columns,
    needs_exact_read,
    parse_sqlite_bucket,
)
from batchtap.ui.endedruns import ENDED_BYTES, EndedRuns
from batchtap.ui.running import VERIFY_S, RunningRuns

__all__ = ["ReadOnlyStore", "MAX_WIDTH", "MIN_WIDTH", "clean", "best_is_max", "SeriesKey"]

#: Bounds on the number of buckets a request may ask for (the chart's width in pixels).
MIN_WIDTH = 10
MAX_WIDTH = 4000
#: Raw points are sent while a range holds at most this many points per bucket.
RAW_PER_BUCKET = 2
#: How much of a SQLite store each of the view's connections maps into memory (``PRAGMA
#: mmap_size``): the mapped pages count in the server's RSS once per connection, so the view's
#: share is ``connections x MMAP_BYTES`` (4 x 32 MiB) whatever the store's size; past it pages are
#: read through SQLite's page cache (2 MiB per connection) from the OS file cache.
MMAP_BYTES = 32 << 20
#: Rows of the ranks' lines read per statement by :meth:`ReadOnlyStore.rank_spread`.
RANK_PAGE = 100_000
#: Events sent for one run at most (the newest are dropped past it, and the page says so).
MAX_EVENTS = 20_000


@dataclasses.dataclass(frozen=True, slots=True)
class SeriesKey:
    """Which stored rows make one line: a run's metric at one rank (``-1``: reduced over ranks)."""

    run_id: str
    metric: str
    rank: int


class ReadOnlyStore:
    """The browser view's reads: JSON-ready dicts over one read-only :class:`batchtap.store.Store`.

    Args:
        url: SQLite path, ``sqlite:///path`` or ``postgresql://...``.
        schema: PostgreSQL schema holding the tables (``None``: the server's ``search_path``).
        connections: most connections open at once (the server's threads share them; more than
            the cores the database reads can use only adds memory).
        idle_s: an unused connection is closed after this many seconds.
        mmap_bytes: SQLite only: bytes of the file each connection maps (:data:`MMAP_BYTES`; 0: none).
        cache_points: points of decimated lines kept in memory, all lines together (:class:`LineCache`).
        ended_bytes: bytes of ended runs' rows and summaries kept in memory (:class:`EndedRuns`).
        verify_s: seconds between two checks of a running run's rows below what was read
            (:mod:`batchtap.ui.running`).

    Raises:
        StoreError: missing, unreachable, not a batchtap store, or at another schema version.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        schema: str | None = None,
        connections: int = 4,
        idle_s: float = 10.0,
        mmap_bytes: int = MMAP_BYTES,
        cache_points: int = CACHE_POINTS,
        ended_bytes: int = ENDED_BYTES,
        verify_s: float = VERIFY_S,
    ) -> None:
        import batchtap.store

        #: the one reader; every read below goes through it.
        self.reader: Store = batchtap.store.open(
            url, schema=schema, migrate=False, connections=connections, idle_s=idle_s, mmap_bytes=mmap_bytes
        )
        self.where = self.reader.where
        self.dialect: Dialect = self.reader.dialect
        #: Decimated lines of runs that have ended, kept between requests (see :class:`LineCache`).
        self.lines = LineCache(cache_points)
        #: Rows and summaries of runs that have ended, kept between requests (see :class:`EndedRuns`).
        self.ended = EndedRuns(ended_bytes)
        #: Running runs' figures, read incrementally (see :class:`RunningRuns`).
        self.running = RunningRuns(
            self._all,
            sparse_names=self.reader.sparse_names,
            metric_names=self.reader.metric_names,
            rolled_back=self.reader.rolled_back,
            verify_s=verify_s,
        )
        #: The last row and summary of each running run (what :meth:`summary` gives for that row).
        self._running_rows: dict[str, tuple[RunRow, dict[str, Any]]] = {}
        #: Rows fetched by this view's own statements (the running runs' polls among them): what the
        #: tests count to see that a poll reads only the new rows.
        self.rows_read = 0

    def close(self) -> None:
        """Close every connection."""
        self.reader.close()

    def _all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        rows = self.reader.query(sql, params)
        self.rows_read += len(rows)
        return rows

    def _one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = self._all(sql, params)
        return rows[0] if rows else None

    # -- runs ------------------------------------------------------------------------------
    def resolve(self, ref: str) -> str | None:
        """The id of the run ``ref`` names (id, unique id prefix such as the short id, or name);
        ``None`` when none matches."""
        try:
            return self.reader.run_id(ref)
        except RunNotFound:
            return None

    def runs(self, query: str | None = None) -> list[dict[str, Any]]:
        """Every run, newest first, as a runs-table row (see the module's documentation), those
        matching ``query`` when given.

        Raises:
            QueryError: the query does not parse or names a key no run has.
        """
        parsed = runquery.parse(query) if query else None
        listing = self._listing()
        read = [self._row_and_summary(rid, fingerprint, ended) for rid, (fingerprint, ended) in listing.items()]
        self.ended.forget(set(listing))
        running = {rid for rid, (_, ended) in listing.items() if not ended}
        self.running.keep_only(running)
        for rid in [r for r in self._running_rows if r not in running]:
            self._running_rows.pop(rid, None)
        read.sort(key=lambda pair: (-pair[0].started_at, pair[0].id))
        out = [dict(summary) for _, summary in read]
        return parsed.filter(out) if parsed is not None else out

    def _listing(self) -> dict[str, tuple[tuple[Any, ...], bool]]:
        """Every run's fingerprint (its runs-table row and event count: what can still change about
        a run that has ended) and whether it has ended; reads the runs table and the events' index,
        never the values."""
        events = dict(self._all("SELECT run_id, COUNT(*) FROM events GROUP BY run_id"))
        out: dict[str, tuple[tuple[Any, ...], bool]] = {}
        for rid, stored, ended_at, reason, env, declared in self._all(
            "SELECT id, status, ended_at, stop_reason, environment, metric_names FROM runs"
        ):
            status, _ = status_of(str(stored), reason, json_object(env))
            fingerprint = (stored, ended_at, reason, env, declared, events.get(rid, 0))
            out[str(rid)] = (fingerprint, status.value != "running")
        return out

    def _row_and_summary(self, run_id: str, fingerprint: tuple[Any, ...], ended: bool) -> tuple[RunRow, dict[str, Any]]:
        def read(rid: str) -> tuple[RunRow, dict[str, Any]]:
            if ended:  # read once in full, then kept (EndedRuns)
                self.running.forget(rid)
                self._running_rows.pop(rid, None)
                row = self.reader.run(rid)
                return row, self._summarise(row)
            row, main = self.running.poll(rid, self.reader.main_metric)
            got = row, self._summarise(row, main=(main,))
            self._running_rows[rid] = got
            return got

        return self.ended.get(run_id, fingerprint, ended=ended, read=read)

    def _kept_row(self, run_id: str, listing: dict[str, tuple[tuple[Any, ...], bool]] | None = None) -> RunRow:
        """A run's row, kept when it has ended (:class:`EndedRuns`); ``listing``: a
        :meth:`_listing` already read.

        Raises:
            RunNotFound: no such run.
        """
        got = (self._listing() if listing is None else listing).get(run_id)
        if got is None:
            raise RunNotFound(f"no run {run_id!r} in {self.where}", ref=run_id)
        return self._row_and_summary(run_id, *got)[0]

    def run(self, ref: str) -> dict[str, Any] | None:
        """One run (id, unique id prefix or name) with its summary, metric names, sparse names and
        ranks; ``None`` when there is no such run."""
        try:
            row = self._kept_row(self.reader.run_id(ref))
        except RunNotFound:
            return None
        run = self.summary(row)
        names = self.reader.metric_names(row.id)
        run["metrics"] = names
        run["sparse"] = self.reader.sparse_names(row.id)
        run["ranks"] = {m: self.ranks(row.id, m) for m in names}
        return run

    def status(self, run_id: str) -> tuple[str, float | None, str | None] | None:
        """A run's status (``killed`` derived as the CLI does), end time and stop reason
        (``None``: no such run)."""
        try:
            status, ended, reason = self.reader.status(run_id)
        except RunNotFound:
            return None
        return status.value, ended, reason

    def summary(self, row: RunRow) -> dict[str, Any]:
        """A run as a runs-table row: its stored fields, and the main metric (``loss`` when the
        run has it) summed up on the kept trajectory by the reader (:meth:`Store.summary`); the
        kept one when ``row`` is an ended run's kept row."""
        kept = self.ended.summary_of(row)
        if kept is None:
            last = self._running_rows.get(row.id)
            kept = last[1] if last is not None and last[0] is row else None
        return dict(kept) if kept is not None else self._summarise(row)

    def _summarise(self, row: RunRow, main: tuple[MetricSummary | None] | None = None) -> dict[str, Any]:
        """``row`` as a runs-table row; ``main``: its main metric's summary already read (a running
        run's, :class:`RunningRuns`), else it is read here."""
        run: dict[str, Any] = {
            "id": row.id,
            "short_id": row.id[:8],
            "name": row.name,
            "status": row.status.value,
            "started_at": row.started_at,
            "ended_at": row.ended_at,
            "stop_reason": row.stop_reason,
            "config": row.config,
            "world_size": row.world_size,
            "environment": row.environment,
            "declared": list(row.metrics),
            "tags": list(row.tags),
            "notes": row.notes,
            "steps": row.steps,
            "last_wall": row.last_wall_time,
            "duration": None if row.duration is None else max(0.0, row.duration),
        }
        name = self.reader.main_metric(row) if main is None else (None if main[0] is None else main[0].metric)
        undone = self.reader.rolled_back(row.id)
        run.update(main=name, higher_is_better=None, last_step=None, last_value=None, best_value=None)
        run.update(min_value=None, max_value=None, rolled_back=[[r.start, r.stop - 1] for r in undone])
        if name is not None:
            s = self.reader.summary(row.id, name, undone=undone) if main is None else main[0]
            assert s is not None
            run.update(
                higher_is_better=s.higher_is_better,
                last_step=s.last_step,
                last_value=clean(s.last),
                best_value=clean(s.best),
                min_value=clean(s.min),
                max_value=clean(s.max),
            )
        kinds = self._all("SELECT kind, COUNT(*) FROM events WHERE run_id = ? GROUP BY kind", (row.id,))
        run["events"] = {str(k): int(n) for k, n in kinds}
        run["anomalies"] = run["events"].get("anomaly", 0)
        return run

    def changes(self, seen: dict[str, tuple[Any, ...]]) -> tuple[list[RunRow], list[str]]:
        """The runs new or moved since ``seen`` (id -> fingerprint, updated in place) and the ids
        gone: what the live runs table sends.

        A poll reads the runs table (no scan of values) and, for each running run, the last step
        of its main metric (one key probe); only the runs that moved are read in full. A running
        run always counts as moved (its duration grows)."""
        rows = self._all("SELECT id, status, ended_at, stop_reason, environment, metric_names FROM runs")
        now: dict[str, tuple[Any, ...]] = {}
        for rid, stored, ended, reason, env, declared in rows:
            status, _ = status_of(str(stored), reason, json_object(env))
            last = None
            if status.value == "running":
                names = ["loss", *(json.loads(declared) if declared else [])]
                for name in names:
                    got = self._one("SELECT MAX(step) FROM metrics WHERE run_id = ? AND metric = ?", (rid, name))
                    if got is not None and got[0] is not None:
                        last = int(got[0])
                        break
            now[str(rid)] = (status.value, ended, last)
        moved_ids = [rid for rid, fp in now.items() if seen.get(rid) != fp or fp[0] == "running"]
        gone = [rid for rid in seen if rid not in now]
        seen.clear()
        seen.update(now)
        moved = []
        listing = self._listing() if moved_ids else {}
        for rid in moved_ids:
            try:
                moved.append(self._kept_row(rid, listing))
            except RunNotFound:
                continue  # removed meanwhile
        return moved, gone

    def metric_names(self, run_id: str) -> list[str]:
        """Names with stored values: declared ones in their order, then the others sorted, then
        the names logged with ``Tap.log()``."""
        return self.reader.metric_names(run_id)

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

    def epochs(self, ref: str) -> list[list[int]]:
        """A run's epochs as ``[[epoch, first step, last step], ...]`` in step order, from the rows
        of its main metric at its first rank; ``[]`` without values (or no such run).

        One aggregate over that line's primary-key range (about 0.3 s for a million steps on a
        loaded machine): a separate request, so that a run page's other reads never wait for it.
        A window over the key order (an epoch starts where the stored epoch changes) reads the
        same rows but costs about five times as much in SQLite."""
        try:
            row = self._kept_row(self.reader.run_id(ref))
        except RunNotFound:
            return []
        metric = self.reader.main_metric(row)
        rank = None if metric is None else self._first_rank(row.id, metric)
        if rank is None or metric is None:
            return []
        if row.status.value == "running":  # read incrementally (RunningRuns.epochs)
            return self.running.epochs(row.id, metric, rank)
        rows = self._all(
            "SELECT epoch, MIN(step), MAX(step) FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?"
            " GROUP BY epoch ORDER BY MIN(step)",
            (row.id, metric, rank),
        )
        return [[int(e), int(first), int(last)] for e, first, last in rows]

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
                return columns("raw", 0, [], 1)
        lo = -(2**62) if start is None else int(start)
        hi = 2**62 if end is None else int(end)
        limit = RAW_PER_BUCKET * width
        rows = self._all(
            "SELECT step, value, wall_time FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?"
            " AND step >= ? AND step <= ? ORDER BY step LIMIT ?",
            (run_id, metric, rank, lo, hi, limit + 1),
        )
        if len(rows) <= limit:
            return columns("raw", rank, rows, 1)
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
            lambda: minmax_columns(rank, self.buckets(key, first_step, last_step, bucket), bucket, last_step),
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
        return columns("raw", rank, rows, 1)

    def rank_spread(self, run_id: str, metric: str, *, width: int = 1000) -> dict[str, Any]:
        """Per step, over the ranks' own rows (``per_rank_rows``): the slowest (largest) rank, the
        largest and smallest value and their spread; bucketed to ``width`` by the step's largest
        spread, so a straggler step is never averaged away.

        The rows are read in pages of :data:`RANK_PAGE` (whole steps, in key order) and only each
        bucket's chosen step is kept: memory in proportion to ``width``, not to the run (a run of
        10^6 steps x 8 ranks read at once was ~1.5 GB of Python objects). The buckets cut the steps
        counted first; steps stored after that count are left for the next request."""
        import numpy as np

        key = (run_id, metric)
        counted = self._one(
            "SELECT COUNT(DISTINCT step) FROM metrics WHERE run_id = ? AND metric = ? AND rank >= 0", key
        )
        total = int(counted[0]) if counted and counted[0] is not None else 0
        if not total:
            return {"step": [], "max": [], "min": [], "spread": [], "slowest": [], "ranks": []}
        width = max(MIN_WIDTH, min(MAX_WIDTH, int(width)))
        edges = np.linspace(0, total, width + 1).astype(int) if total > RAW_PER_BUCKET * width else None
        chosen: dict[int, tuple[float, int, float, float, int, float]] = {}  # bucket (or step index) -> point
        ranks_seen: set[int] = set()
        index, after = 0, -(2**62) - 1
        while index < total:
            rows = self._all(
                "SELECT step, rank, value FROM metrics WHERE run_id = ? AND metric = ? AND rank >= 0 AND step > ?"
                " ORDER BY step, rank LIMIT ?",
                (*key, after, RANK_PAGE),
            )
            if not rows:
                break
            arr = np.array([(st, r, np.nan if v is None else v) for st, r, v in rows], dtype=float)
            if len(rows) == RANK_PAGE and (arr[:, 0] < arr[-1, 0]).any():
                arr = arr[arr[:, 0] < arr[-1, 0]]  # the page's last step may go on in the next page
            steps, where = np.unique(arr[:, 0], return_inverse=True)
            ranks = np.unique(arr[:, 1]).astype(int)
            ranks_seen.update(int(r) for r in ranks)
            grid = np.full((len(steps), len(ranks)), np.nan)
            grid[where, np.searchsorted(ranks, arr[:, 1].astype(int))] = arr[:, 2]
            high_grid = np.where(np.isnan(grid), -np.inf, grid)
            high = high_grid.max(axis=1)
            low = np.where(np.isnan(grid), np.inf, grid).min(axis=1)
            slowest = np.where(high == -np.inf, -1, ranks[np.argmax(high_grid, axis=1)])  # -1: no value
            with np.errstate(all="ignore"):
                spread = high - low
            score = np.nan_to_num(spread, nan=-1)
            for i in range(len(steps)):
                at = index + i
                if at >= total:
                    break
                slot = at if edges is None else int(np.searchsorted(edges, at, side="right")) - 1
                got = chosen.get(slot)
                if got is None or score[i] > got[0]:
                    chosen[slot] = (score[i], int(steps[i]), high[i], low[i], int(slowest[i]), spread[i])
            index += len(steps)
            after = int(steps[-1])
        first_rank = min(ranks_seen)
        points = [chosen[k] for k in sorted(chosen)]
        return {
            "step": [p[1] for p in points],
            "max": [clean(p[2]) for p in points],
            "min": [clean(p[3]) for p in points],
            "spread": [clean(p[5]) for p in points],
            "slowest": [first_rank if p[4] == -1 else p[4] for p in points],
            "ranks": sorted(ranks_seen),
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
