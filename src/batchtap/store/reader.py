"""Reading a store: runs, one run's metric series, its sparse (``Tap.log()``) values, events.

The one reader of the project: the ``batchtap`` CLI, the Python API (``batchtap.store.open``) and the
browser view (``batchtap.ui.data`` turns its results into JSON) all read through :class:`Store`, so
they agree on a run's status (including the derived ``killed``), its steps, and its best and last
values (on the kept trajectory: steps a rollback undid are left out of every summary).

A reader never creates a store and never writes, except to apply the migrations an older store
lacks (``migrate=False`` refuses such a store instead). Its connections are read-only and shared by
its threads through a bounded pool (:class:`~batchtap.store.connect.ConnectionPool`): one per
concurrent call, closed when idle. On SQLite it reads while a training process writes (WAL mode:
readers see every committed block and never wait for the writer).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from batchtap.records import Event, EventKind, Record, RunStatus
from batchtap.store.connect import ConnectionPool, connect_postgres, connect_sqlite
from batchtap.store.errors import MetricNotFound, RunNotFound, StoreError
from batchtap.store.handle import ReadHandle
from batchtap.store.rows import (
    RUN_SELECT,
    MetricSummary,
    Point,
    RunRow,
    best_is_max,
    json_object,
    killed_reason,
    run_from_row,
    status_of,
)
from batchtap.store.schema import POSTGRES, SQLITE, Dialect, text_to_float
from batchtap.store.url import parse_url

__all__ = ["open", "Store", "RunRow", "Point", "MetricSummary", "best_is_max", "killed_reason"]

_NAN = float("nan")
# A rollback's action event names the steps it undid: "undone steps 51..55" (recovery/rollback.py).
_UNDONE = re.compile(r"\bundone steps (\d+)\.\.(\d+)")


class Store(ReadHandle):
    """A read handle on a batchtap store; make one with :func:`open`. Use it as a context manager.

    The connections, :meth:`query` and the life cycle come from :class:`~batchtap.store.handle.ReadHandle`;
    this class holds the queries.

    Example (a run of three steps and one value logged with ``Tap.log()``):
        >>> import tempfile, os, batchtap.store
        >>> from batchtap.sinks.sqlite import SQLite
        >>> from batchtap.records import Record, RunInfo
        >>> path = os.path.join(tempfile.mkdtemp(), "bt.db")
        >>> sink = SQLite(path)
        >>> sink.start_run(RunInfo("a1b2", "demo", {}, started_at=0.0))
        >>> sink.write([Record("a1b2", step=s, epoch=0, batch=s, rank=0, wall_time=1.0 + s,
        ...                    values={"loss": v}) for s, v in enumerate([0.9, 0.5, 0.7])])
        >>> sink.write([Record("a1b2", step=2, epoch=0, batch=-1, rank=0, wall_time=3.5,
        ...                    values={"val_acc": 0.75}, sparse=True)])
        >>> sink.close()
        >>> with batchtap.store.open(path) as st:
        ...     run = st.run("demo")
        ...     first = st.series(run.id, "loss")[0]
        ...     s = st.summary("demo", "loss")
        ...     frame = st.frame("demo")
        >>> first
        Point(step=0, value=0.9, wall_time=1.0, epoch=0, batch=0)
        >>> s.last, s.min, s.best, s.count
        (0.7, 0.5, 0.5, 3)
        >>> print(frame)  # doctest: +NORMALIZE_WHITESPACE
              loss  val_acc
        step
        0      0.9      NaN
        1      0.5      NaN
        2      0.7     0.75
    """

    # -- runs -------------------------------------------------------------------------------
    def runs(self) -> list[RunRow]:
        """Every run, oldest first, with its status, step count and timings."""
        rows = self._all(RUN_SELECT.format(where="") + " ORDER BY r.started_at, r.id")
        return [run_from_row(r) for r in rows]

    def _one_run(self, run_id: str) -> RunRow | None:
        rows = self._all(RUN_SELECT.format(where="m.run_id = ? AND ") + " WHERE r.id = ?", (run_id, run_id))
        return run_from_row(rows[0]) if rows else None

    def _id(self, run: str | RunRow) -> str:
        """The id of a run given as :meth:`run` takes it (id, name, unique id prefix) or as a
        :class:`RunRow`; one index probe when it is an id (what the CLI and the frame pass)."""
        if isinstance(run, RunRow):
            return run.id
        if not isinstance(run, str):
            raise TypeError(
                f"a run must be given as its id, unique id prefix or name (str) or as a RunRow, got "
                f"{type(run).__name__}; fix: pass run.id or the run's name"
            )
        return self.run_id(run)

    def run(self, ref: str | RunRow) -> RunRow:
        """Find one run by exact id, exact name (the latest run of that name wins) or unique id prefix.

        Raises:
            RunNotFound: nothing matches, or an id prefix matches several runs; the message lists
                the closest names and ids.
        """
        found = self._one_run(self.run_id(ref))
        if found is None:  # deleted between the two reads
            raise RunNotFound(
                f"run {ref!r} is no longer in {self.where}; fix: run `batchtap runs` to list the runs",
                ref=ref if isinstance(ref, str) else ref.id,
            )
        return found

    def run_id(self, ref: str | RunRow) -> str:
        """The id of the run ``ref`` names, as :meth:`run` finds it (exact id, exact name, unique id
        prefix), from the runs table alone: no read of the run's values (what a view resolving a
        short id on every request needs; :meth:`run`'s step figures scan them).

        Raises:
            RunNotFound: as :meth:`run`.
        """
        if isinstance(ref, RunRow):
            return ref.id
        if not isinstance(ref, str):
            raise TypeError(f"a run must be given as its id, unique id prefix or name (str), got {type(ref).__name__}")
        if self._all("SELECT 1 FROM runs WHERE id = ?", (ref,)):
            return ref
        named = self._all("SELECT id FROM runs WHERE name = ? ORDER BY started_at DESC, id DESC LIMIT 1", (ref,))
        if named:
            return str(named[0][0])
        prefixed = [
            r[0]
            for r in self._all("SELECT id FROM runs WHERE substr(id, 1, ?) = ? ORDER BY id LIMIT 50", (len(ref), ref))
        ]
        if len(prefixed) == 1:
            return str(prefixed[0])
        if len(prefixed) > 1:
            raise RunNotFound(
                f"run id prefix {ref!r} is ambiguous in {self.where}: it matches {', '.join(prefixed[:10])}; "
                "expected a prefix matching one run; fix: give more characters of the id",
                ref=ref,
                candidates=tuple(prefixed),
            )
        known = self._all("SELECT DISTINCT name FROM runs") + self._all("SELECT id FROM runs")
        close = tuple(difflib.get_close_matches(ref, [k[0] for k in known], n=5, cutoff=0.4))
        hint = f"closest: {', '.join(repr(c) for c in close)}" if close else "the store has no similar names"
        raise RunNotFound(
            f"no run {ref!r} in {self.where} (looked for an exact id, a name, and an id prefix); "
            f"{hint}; fix: run `batchtap runs` to list the runs",
            ref=ref,
            candidates=close,
        )

    def status(self, run: str | RunRow) -> tuple[RunStatus, float | None, str | None]:
        """A run's status (``killed`` derived as in :class:`RunRow`), end time and stop reason: one
        probe of the runs table, no scan of its values (what a live view polls).

        Raises:
            RunNotFound: no such run.
        """
        run_id = self._id(run)
        rows = self._all("SELECT status, ended_at, stop_reason, environment FROM runs WHERE id = ?", (run_id,))
        stored, ended, reason, env = rows[0]
        status, reason = status_of(stored, reason, json_object(env))
        return status, None if ended is None else float(ended), reason

    def rolled_back(self, run: str | RunRow) -> tuple[range, ...]:
        """The steps of a run that rollbacks undid (an abandoned trajectory), in order.

        Their values stay stored (the charts draw them as what happened) but no summary counts them:
        :meth:`summary`, the best value, ``batchtap show``/``runs``, the browser view and :meth:`frame`
        read the kept trajectory.
        """
        run_id = self._id(run)
        rows = self._all(
            "SELECT message FROM events WHERE run_id = ? AND kind = ? AND message LIKE ?",
            (run_id, EventKind.ACTION.value, "%undone steps %"),
        )
        out = []
        for (message,) in rows:
            found = _UNDONE.search(str(message))
            if found:
                out.append(range(int(found.group(1)), int(found.group(2)) + 1))
        return tuple(sorted(out, key=lambda r: (r.start, r.stop)))

    @staticmethod
    def _kept(undone: Sequence[range]) -> tuple[str, tuple[Any, ...]]:
        """SQL (`` AND ...``) and its parameters leaving out the steps in ``undone``."""
        sql = "".join(" AND NOT (step >= ? AND step <= ?)" for _ in undone)
        return sql, tuple(v for r in undone for v in (r.start, r.stop - 1))

    def summary(
        self,
        run: str | RunRow,
        metric: str,
        rank: int | None = None,
        *,
        undone: Sequence[range] | None = None,
    ) -> MetricSummary:
        """One metric summed up on the run's kept trajectory: count, NaNs, last, min, max, best.

        Args:
            run: the run's id, unique id prefix or name, or a :class:`RunRow`.
            metric: the metric.
            rank: as :meth:`series` (default: the reduced rows when stored, else the lowest rank).
            undone: the steps to leave out (default: :meth:`rolled_back`; pass it when summing up
                several metrics of one run).

        Raises:
            RunNotFound: no such run.
            MetricNotFound: the run has no metric of that name.

        Example: see :class:`Store`.
        """
        run_id = self._id(run)
        if rank is None:
            rank = self._default_rank(run_id, metric)
        higher = best_is_max(metric)
        if rank is None:
            self._check_metric(run_id, metric)
            return MetricSummary(metric, 0, 0, 0, None, None, None, None, None, higher)
        kept, kept_params = self._kept(self.rolled_back(run_id) if undone is None else undone)
        key = (run_id, metric, rank)
        # NaN is stored as NULL; +-inf stay, but are not a finite min or max.
        agg = self._all(
            "SELECT COUNT(*), COUNT(value) FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?" + kept,
            key + kept_params,
        )[0]
        bounds = self._all(
            "SELECT MIN(value), MAX(value) FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?"
            " AND value > ? AND value < ?" + kept,
            key + (-math.inf, math.inf) + kept_params,
        )[0]
        last = self._all(
            "SELECT step, value, wall_time FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?"
            + kept
            + " ORDER BY step DESC LIMIT 1",
            key + kept_params,
        )
        return MetricSummary(
            metric=metric,
            rank=rank,
            count=int(agg[0]),
            nans=int(agg[0]) - int(agg[1]),
            last=(None if not last else _NAN if last[0][1] is None else float(last[0][1])),
            last_step=None if not last else int(last[0][0]),
            last_wall_time=None if not last else float(last[0][2]),
            min=None if bounds[0] is None else float(bounds[0]),
            max=None if bounds[1] is None else float(bounds[1]),
            higher_is_better=higher,
        )

    def main_metric(self, run: str | RunRow) -> str | None:
        """The metric a run is judged by in tables: ``loss`` when it has values, else its first
        declared metric with values, else its first step metric; ``None`` without any."""
        row = run if isinstance(run, RunRow) else self.run(run)
        for name in ["loss", *(m for m in row.metrics if m != "loss")]:
            if self._all("SELECT 1 FROM metrics WHERE run_id = ? AND metric = ? LIMIT 1", (row.id, name)):
                return name
        sparse = set(self.sparse_names(row.id))
        rest = [m for m in self.metric_names(row.id) if m not in sparse]
        return rest[0] if rest else None

    def metric_names(self, run_id: str | RunRow) -> list[str]:
        """Names of the metrics with stored values in a run: the declared ones in their order, then
        other step values sorted, then the names logged with ``Tap.log()`` (:meth:`sparse_names`) sorted.

        ``run_id``: a run id, unique id prefix or name (as :meth:`run` resolves it), or a :class:`RunRow`.

        Raises:
            RunNotFound: no such run (the message lists the closest names).
        """
        run_id = self._id(run_id)
        # A skip scan over the primary key's (run_id, metric) prefix: one index probe per metric
        # instead of reading every row of the run.
        rows = self._all(
            "WITH RECURSIVE m(name) AS ("
            " SELECT MIN(metric) FROM metrics WHERE run_id = ?"
            " UNION ALL"
            " SELECT (SELECT MIN(metric) FROM metrics WHERE run_id = ? AND metric > m.name)"
            " FROM m WHERE m.name IS NOT NULL"
            ") SELECT name FROM m WHERE name IS NOT NULL",
            (run_id, run_id),
        )
        present = {r[0] for r in rows}
        declared = self._all("SELECT metric_names FROM runs WHERE id = ?", (run_id,))
        order = [m for m in (json.loads(declared[0][0]) if declared else []) if m in present]
        sparse = [m for m in self.sparse_names(run_id) if m in present]
        return order + sorted(present.difference(order, sparse)) + sparse

    def sparse_names(self, run_id: str | RunRow) -> list[str]:
        """Names a run logged with ``Tap.log()`` (evaluation, epoch-level values), sorted. Their
        values read like any metric's (:meth:`series`), or grouped as logged (:meth:`sparse_records`).

        Raises:
            RunNotFound: no such run (``run_id`` is resolved as :meth:`run` does).
        """
        run_id = self._id(run_id)
        return [
            r[0] for r in self._all("SELECT metric FROM sparse_metrics WHERE run_id = ? ORDER BY metric", (run_id,))
        ]

    def sparse_records(
        self, run_id: str | RunRow, names: Iterable[str] | None = None, rank: int | None = None
    ) -> list[Record]:
        """A run's ``Tap.log()`` values as the sparse records its sinks were given, in (step, wall
        time, rank) order, read in one statement (so a record is never seen half-committed).

        Values logged in one ``log()`` call share their wall time and come back as one record. A
        name logged again at the same step keeps its last value (it is an update of the same key).

        Args:
            run_id: the run's id, unique id prefix or name, or a :class:`RunRow`.
            names: only these sparse names (default: all of them).
            rank: only this rank (default: every rank stored).

        Raises:
            RunNotFound: no such run.
            MetricNotFound: a name in ``names`` was never logged in the run.
        """
        run_id = self._id(run_id)
        if isinstance(names, str):
            names = [names]  # a lone name, not its characters
        wanted = None if names is None else set(names)
        if wanted:
            logged = self.sparse_names(run_id)
            missing = sorted(wanted.difference(logged))
            if missing:
                raise self._no_metric(run_id, missing[0], logged, "logged with tap.log()")
        sql = (
            "SELECT m.metric, m.step, m.rank, m.epoch, m.batch, m.wall_time, m.value FROM metrics m"
            " JOIN sparse_metrics sp ON sp.run_id = m.run_id AND sp.metric = m.metric WHERE m.run_id = ?"
        )
        params: tuple[Any, ...] = (run_id,)
        if rank is not None:
            sql += " AND m.rank = ?"
            params += (rank,)
        rows = self._all(sql + " ORDER BY m.step, m.wall_time, m.rank, m.metric", params)
        grouped: dict[tuple[int, float, int], tuple[int, int, dict[str, float]]] = {}
        for metric, step, r, epoch, batch, wall, value in rows:
            if wanted is not None and metric not in wanted:
                continue
            key = (int(step), float(wall), int(r))
            if key not in grouped:
                grouped[key] = (int(epoch), int(batch), {})
            grouped[key][2][metric] = _NAN if value is None else float(value)
        return [
            Record(run_id, step=s, epoch=e, batch=b, rank=r, wall_time=w, values=v, sparse=True)
            for (s, w, r), (e, b, v) in grouped.items()
        ]

    def series(self, run_id: str | RunRow, metric: str, rank: int | None = None) -> list[Point]:
        """One metric of one run in step order.

        Args:
            run_id: the run's id, unique id prefix or name (as :meth:`run` resolves it), or a :class:`RunRow`.
            metric: metric name, exactly as recorded.
            rank: process rank, or :data:`batchtap.records.ALL_RANKS`; ``None`` picks the reduced
                series when the run has one, else the lowest rank recorded.

        Returns:
            The points; empty for a metric the run declared but never stored a value of (or none
            at ``rank``).

        Raises:
            RunNotFound: no such run.
            MetricNotFound: the run has no metric of that name (the message lists the closest).
        """
        run_id = self._id(run_id)
        if rank is None:
            rank = self._default_rank(run_id, metric)
            if rank is None:
                self._check_metric(run_id, metric)
                return []
        rows = self._all(
            "SELECT step, value, wall_time, epoch, batch FROM metrics"
            " WHERE run_id = ? AND metric = ? AND rank = ? ORDER BY step",
            (run_id, metric, rank),
        )
        if not rows:
            self._check_metric(run_id, metric)
        return [Point(int(s), _NAN if v is None else float(v), float(w), int(e), int(b)) for s, v, w, e, b in rows]

    def _default_rank(self, run_id: str, metric: str) -> int | None:
        """The rank a metric is read at when none is asked for: the reduced rows (rank -1) when
        stored, else the lowest rank; None when the run stored no value of it."""
        found = self._all("SELECT MIN(rank) FROM metrics WHERE run_id = ? AND metric = ?", (run_id, metric))
        return None if not found or found[0][0] is None else int(found[0][0])

    def _check_metric(self, run_id: str, metric: str) -> None:
        """Raise :class:`MetricNotFound` unless the run stored or declared ``metric``."""
        if not isinstance(metric, str):
            raise TypeError(f"a metric name must be a str, got {type(metric).__name__}")
        declared = self._all("SELECT metric_names FROM runs WHERE id = ?", (run_id,))
        if declared and declared[0][0] and metric in json.loads(declared[0][0]):
            return  # declared, never stored (e.g. no step reached the store yet)
        present = self.metric_names(run_id)
        if metric not in present:
            raise self._no_metric(run_id, metric, present, "with values")

    def _no_metric(self, run_id: str, metric: str, present: Sequence[str], what: str) -> MetricNotFound:
        close = tuple(difflib.get_close_matches(metric, list(present), n=5, cutoff=0.4))
        hint = f"closest: {', '.join(repr(c) for c in close)}" if close else f"it has {', '.join(present) or 'none'}"
        name = self._all("SELECT name FROM runs WHERE id = ?", (run_id,))
        label = f"{name[0][0]!r} ({run_id[:8]})" if name else repr(run_id)
        return MetricNotFound(
            f"run {label} has no metric {metric!r} {what} in {self.where}; {hint}; "
            "fix: use a name from Store.metric_names() (`batchtap show RUN` lists them)",
            ref=metric,
            candidates=close,
        )

    def frame(
        self,
        run: str | RunRow,
        metrics: Sequence[str] | None = None,
        *,
        rank: int | None = None,
        positions: bool = False,
        rolled_back: bool = False,
    ) -> Any:
        """A run as a wide ``pandas.DataFrame``: one row per step (index ``step``), one float column
        per metric, step values first (declared order), then the values logged with ``Tap.log()``.

        Needs pandas (``pip install 'batchtap[pandas]'``). A cell is NaN where the metric has no
        value at that step (a ``Tap.log()`` value exists only at the steps it was logged at) and
        where a value failed validation (:meth:`events` has the anomaly with the raw value).
        ``frame.attrs`` holds ``run_id``, ``run_name`` and ``sparse`` (the logged names shown).

        Args:
            run: a run id, unique id prefix or name (as :meth:`run` resolves it), or a :class:`RunRow`.
            metrics: only these metrics, in this order (default: :meth:`metric_names`).
            rank: one process rank (``-1``: the rows reduced over all ranks); default: per metric,
                the reduced rows when stored, else the lowest rank (as :meth:`series`).
            positions: also give each step's ``epoch``, ``batch`` and ``wall_time`` as the first
                columns (a metric of one of those names is then renamed ``metric:<name>``).
            rolled_back: keep the rows of steps a rollback undid (default: the kept trajectory
                only; ``frame.attrs["rolled_back"]`` lists the undone ranges as ``(first, last)``).

        Raises:
            RunNotFound: no such run.
            StoreError: a name in ``metrics`` has no values in the run (the message lists those it has).
            ImportError: pandas is missing.

        Example: see :class:`Store`.
        """
        from batchtap.store.frame import run_frame

        return run_frame(self, run, metrics, rank=rank, positions=positions, rolled_back=rolled_back)

    def iter_metrics(self, run_id: str | RunRow) -> Iterator[tuple[str, int, int, float]]:
        """Every stored value of a run as ``(metric, step, rank, value)``, by metric then step.

        Raises:
            RunNotFound: no such run (``run_id`` is resolved as :meth:`run` does).
        """
        run_id = self._id(run_id)
        rows = self._stream(
            "SELECT metric, step, rank, value FROM metrics WHERE run_id = ? ORDER BY metric, step, rank", (run_id,)
        )
        for metric, step, rank, value in rows:
            yield metric, int(step), int(rank), _NAN if value is None else float(value)

    def events(self, run_id: str | RunRow) -> list[Event]:
        """Events of a run in step order.

        Raises:
            RunNotFound: no such run (``run_id`` is resolved as :meth:`run` does).
        """
        run_id = self._id(run_id)
        rows = self._all(
            "SELECT run_id, step, kind, message, wall_time, metric, raw_value, rank FROM events"
            " WHERE run_id = ? ORDER BY step, wall_time, event_key",
            (run_id,),
        )
        return [
            Event(rid, int(step), EventKind(kind), msg, float(wall), metric, text_to_float(raw), int(rank))
            for rid, step, kind, msg, wall, metric, raw, rank in rows
        ]


#: How much of a SQLite store each reading connection maps into memory: a decimation scans every
#: row of a line (~30 % faster through the map than a read() per page). The pages are shared
#: between the pool's connections through the page cache, but each mapping counts in the process's
#: RSS: 8 connections on a 96 MB store showed ~700 MB of RSS for ~94 MB of memory. 128 MiB each
#: bounds that for any store size.
MMAP_BYTES = 128 << 20


def open(  # noqa: A001 - the API name
    url: str | os.PathLike[str],
    *,
    schema: str | None = None,
    migrate: bool = True,
    connections: int = 8,
    idle_s: float = 10.0,
    mmap_bytes: int = MMAP_BYTES,
) -> Store:
    """Open a batchtap store for reading.

    Args:
        url: a SQLite file path, ``sqlite:///path``, or ``postgresql://user@host/db``.
        schema: for PostgreSQL, the schema (namespace) holding the tables; ``None`` uses the
            server's ``search_path``.
        migrate: apply the migrations an older store lacks (the one write a reader makes);
            ``False`` refuses such a store and every connection is read-only (the browser view).
        connections: most connections open at once (threads past that wait for one).
        idle_s: an unused connection is closed after this many seconds.
        mmap_bytes: for SQLite, how much of the file each connection maps into memory (``PRAGMA
            mmap_size``; counted in the process's RSS once per connection; 0: none).

    Raises:
        StoreError: the store does not exist, is not a batchtap store, has a newer schema version,
            or the server cannot be reached (the DSN is shown without its password).
    """
    loc = parse_url(url)
    if loc.kind == "sqlite":
        target = loc.target

        def sqlite_conn() -> Any:
            conn = connect_sqlite(target, create=False, migrate=migrate)
            conn.execute(f"PRAGMA mmap_size = {int(mmap_bytes)}")
            return conn

        return _opened(ConnectionPool(sqlite_conn, size=connections, idle_s=idle_s), SQLITE, loc.display())
    if schema is not None and not schema:
        raise StoreError("schema must be a non-empty name or None, got ''")
    dsn = loc.target

    def pg_conn() -> Any:
        return connect_postgres(dsn, schema=schema, create=False, purpose="batchtap.store.open", read_only=not migrate)

    where = loc.display() if schema is None else f"{loc.display()} (schema {schema!r})"
    return _opened(ConnectionPool(pg_conn, size=connections, idle_s=idle_s), POSTGRES, where)


def _opened(pool: ConnectionPool, dialect: Dialect, where: str) -> Store:
    """A store over ``pool`` once one connection opened (a bad path or URL fails here, not later)."""
    with pool.connection():
        pass
    return Store(pool, dialect, where)
