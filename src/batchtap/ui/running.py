"""A running run's runs-table figures, read incrementally: a poll reads only the rows stored since
the last one.

The runs table, its live stream (every second) and a run page ask for a running run's step count,
first and last step, last wall time (:class:`~batchtap.store.rows.RunRow`) and its main metric's
summary (count, NaNs, best, min, max, last on the kept trajectory). Read in full, that is a scan of
every row of the run (3-4 s for a run of 10^6 steps x 6 metrics on the shared machine), again on
every poll. Here each running run keeps what it has read:

* per metric (every rank): the last step read (its high-water mark), the rows read up to it, the
  smallest rank; a poll reads, per metric, the steps after the mark (one row per new step, through
  the primary key ``(run_id, metric, step, rank)``): O(new rows);
* the run's distinct step count, first and last step and last wall time: a new step above every
  mark counts; one at or below another metric's mark (a metric written a flush late) counts only
  when no metric already read had it (one key probe per such step);
* the main metric's line (its default rank: the reduced rows, else the lowest): count, NaNs,
  finite min and max and the last kept row, advanced by the rows after its mark; the steps a
  rollback undid (the events) are left out, and when they change the line is read again.

**Rows below a mark.** batchtap's writers add a line's rows in step order: a resumed run goes on
after the last stored step (:func:`batchtap._resume.resume_point`), a spool is replayed in order and
a block delivered twice (at least once) rewrites the same rows with the same values, each rank
writes its own rows. So nothing below a mark changes, except those identical rewrites. A writer
that does otherwise is still caught: every ``verify_s`` seconds a poll also counts each metric's
rows up to its mark (one row per metric comes back, but the database scans the run's keys) and
reads the run again in full when a count moved; so does a change of the sparse names (``Tap.log``
values are not steps). When the run ends its figures are read once in full
(:class:`batchtap.ui.endedruns.EndedRuns`), so an ended run's figures never depend on this.

The state is a few numbers per metric of each running run (no rows are kept); a run that ended or
is gone is forgotten.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchtap.store.errors import RunNotFound
from batchtap.store.rows import MetricSummary, RunRow, best_is_max, run_from_row

__all__ = ["RunningRuns", "VERIFY_S"]

#: Seconds between two counts of a running run's rows below its marks (see the module's text).
VERIFY_S = 30.0

_RUNS_ROW = (
    "SELECT id, name, status, started_at, ended_at, stop_reason, config, world_size, environment, metric_names"
    " FROM runs WHERE id = ?"
)
_NOT_SPARSE = " AND NOT EXISTS (SELECT 1 FROM sparse_metrics sp WHERE sp.run_id = m.run_id AND sp.metric = m.metric)"
# One statement (one snapshot of the store): per metric its rows, first and last step, last wall
# time and smallest rank; then the run's distinct steps over the metrics that are not sparse
# (what RUN_SELECT counts).
_BUILD = (
    "SELECT metric, COUNT(*), MIN(step), MAX(step), MAX(wall_time), MIN(rank) FROM metrics m WHERE run_id = ?"
    + _NOT_SPARSE
    + " GROUP BY metric UNION ALL SELECT NULL, COUNT(DISTINCT step), MIN(step), MAX(step), MAX(wall_time), NULL"
    " FROM metrics m WHERE run_id = ?" + _NOT_SPARSE
)
# The steps of one metric after its mark: one row per step (ranks together), in key order.
_NEW_STEPS = (
    "SELECT step, COUNT(*), MAX(wall_time), MIN(rank) FROM metrics WHERE run_id = ? AND metric = ? AND step > ?"
    " GROUP BY step ORDER BY step"
)
_LINE_AGG = (
    "SELECT 0, COUNT(*), COUNT(value), MIN(CASE WHEN value > ? AND value < ? THEN value END),"
    " MAX(CASE WHEN value > ? AND value < ? THEN value END), NULL FROM metrics"
    " WHERE run_id = ? AND metric = ? AND rank = ?{kept}"
    " UNION ALL SELECT 1, COUNT(*), MAX(step), NULL, NULL, NULL FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?"
    " UNION ALL SELECT 2, step, value, wall_time, NULL, NULL FROM (SELECT step, value, wall_time FROM metrics"
    " WHERE run_id = ? AND metric = ? AND rank = ?{kept} ORDER BY step DESC LIMIT 1) last_row"
)
_LINE_NEW = (
    "SELECT step, value, wall_time FROM metrics WHERE run_id = ? AND metric = ? AND rank = ? AND step > ? ORDER BY step"
)
_EPOCHS = (
    "SELECT epoch, MIN(step), MAX(step), COUNT(*) FROM metrics WHERE run_id = ? AND metric = ? AND rank = ?"
    " AND step > ? GROUP BY epoch"
)
_COUNT_BELOW = "SELECT COUNT(*) FROM metrics WHERE run_id = ? AND metric = ? AND step <= ?"
_COUNT_LINE_BELOW = "SELECT COUNT(*) FROM metrics WHERE run_id = ? AND metric = ? AND rank = ? AND step <= ?"


@dataclasses.dataclass
class _Metric:
    hwm: int  # the largest step read
    rows: int  # rows read (every rank), all at steps <= hwm
    rank: int  # the smallest rank read


@dataclasses.dataclass
class _Line:
    """The main metric's line at one rank, on the kept trajectory."""

    metric: str
    rank: int
    undone: tuple[range, ...]
    hwm: int | None  # the largest step read (kept or not)
    rows: int  # rows read (kept or not)
    count: int = 0
    values: int = 0  # count of non-NaN values
    low: float | None = None
    high: float | None = None
    last: tuple[int, float | None, float] | None = None

    def summary(self) -> MetricSummary:
        value = None if self.last is None else (math.nan if self.last[1] is None else float(self.last[1]))
        return MetricSummary(
            metric=self.metric,
            rank=self.rank,
            count=self.count,
            nans=self.count - self.values,
            last=value,
            last_step=None if self.last is None else int(self.last[0]),
            last_wall_time=None if self.last is None else float(self.last[2]),
            min=self.low,
            max=self.high,
            higher_is_better=best_is_max(self.metric),
        )


@dataclasses.dataclass
class _Epochs:
    """A line's epochs: epoch -> [first step, last step], read up to ``hwm``."""

    key: tuple[str, str, int]
    hwm: int
    rows: int
    spans: dict[int, list[int]]
    verified_at: float


@dataclasses.dataclass
class _Run:
    sparse: frozenset[str]
    metrics: dict[str, _Metric]
    steps: int
    first: int | None
    last: int | None
    wall: float | None
    verified_at: float
    line: _Line | None = None


def _kept_sql(undone: Sequence[range]) -> tuple[str, tuple[int, ...]]:
    sql = "".join(" AND NOT (step >= ? AND step <= ?)" for _ in undone)
    return sql, tuple(v for r in undone for v in (r.start, r.stop - 1))


def _finite(v: Any) -> bool:
    return v is not None and math.isfinite(float(v))


class RunningRuns:
    """Incremental figures of running runs (see the module's text).

    Args:
        query: runs one read-only statement (``?`` placeholders) and returns its rows.
        sparse_names: a run's ``Tap.log()`` names (:meth:`batchtap.store.Store.sparse_names`).
        metric_names: a run's names with stored values (:meth:`batchtap.store.Store.metric_names`).
        rolled_back: the steps a run's rollbacks undid (:meth:`batchtap.store.Store.rolled_back`).
        verify_s: seconds between two counts of the rows below the marks.
        clock: a monotonic clock (seconds).
    """

    def __init__(
        self,
        query: Callable[[str, Sequence[Any]], list[tuple[Any, ...]]],
        *,
        sparse_names: Callable[[str], list[str]],
        metric_names: Callable[[str], list[str]],
        rolled_back: Callable[[str], tuple[range, ...]],
        verify_s: float = VERIFY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._q = query
        self._sparse_names = sparse_names
        self._metric_names = metric_names
        self._rolled_back = rolled_back
        self.verify_s = verify_s
        self._clock = clock
        self._runs: dict[str, _Run] = {}
        self._epochs: dict[str, _Epochs] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        #: full reads of a run's figures (the first poll, and each time a count check or the sparse
        #: names asked for one): what a test counts.
        self.builds = 0

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._runs

    def forget(self, run_id: str) -> None:
        """Drop what is kept of a run (it ended, or is gone)."""
        with self._guard:
            self._runs.pop(run_id, None)
            self._epochs.pop(run_id, None)
            self._locks.pop(run_id, None)

    def keep_only(self, run_ids: set[str]) -> None:
        """Drop what is kept of every run not in ``run_ids``."""
        with self._guard:
            for rid in [r for r in {*self._runs, *self._epochs} if r not in run_ids]:
                self._runs.pop(rid, None)
                self._epochs.pop(rid, None)
                self._locks.pop(rid, None)

    def epochs(self, run_id: str, metric: str, rank: int) -> list[list[int]]:
        """A running run's epochs from one line, as :meth:`batchtap.ui.data.ReadOnlyStore.epochs`
        gives them (``[[epoch, first step, last step], ...]`` by first step), the line's rows after
        the last step read added to what was read (an epoch's span grows, a new epoch appears);
        the rows below it counted every ``verify_s`` as for the figures."""
        with self._guard:
            lock = self._locks.setdefault(run_id, threading.Lock())
        with lock:
            key = (run_id, metric, rank)
            kept = self._epochs.get(run_id)
            if kept is not None and kept.key == key and self._clock() - kept.verified_at >= self.verify_s:
                (got,) = self._q(_COUNT_LINE_BELOW, (run_id, metric, rank, kept.hwm))
                if int(got[0]) == kept.rows:
                    kept.verified_at = self._clock()
                else:
                    kept = None
            if kept is None or kept.key != key:
                self.builds += 1
                kept = self._epochs[run_id] = _Epochs(key, -(2**62) - 1, 0, {}, self._clock())
            for epoch, first, last, n in self._q(_EPOCHS, (*key, kept.hwm)):
                span = kept.spans.setdefault(int(epoch), [int(first), int(last)])
                span[0], span[1] = min(span[0], int(first)), max(span[1], int(last))
                kept.rows += int(n)
            kept.hwm = max([kept.hwm, *(span[1] for span in kept.spans.values())])
            return [[e, a, b] for e, (a, b) in sorted(kept.spans.items(), key=lambda item: item[1][0])]

    def poll(self, run_id: str, main_metric: Callable[[RunRow], str | None]) -> tuple[RunRow, MetricSummary | None]:
        """The run's row (its figures read incrementally) and its main metric's summary on the kept
        trajectory (``None`` without a main metric); ``main_metric`` picks it from the row.

        Raises:
            RunNotFound: no such run.
        """
        with self._guard:
            lock = self._locks.setdefault(run_id, threading.Lock())
        with lock:
            head = self._q(_RUNS_ROW, (run_id,))
            if not head:
                self.forget(run_id)
                raise RunNotFound(f"no run {run_id!r}", ref=run_id)
            sparse = frozenset(self._sparse_names(run_id))
            state = self._runs.get(run_id)
            if state is not None and state.sparse == sparse and self._advance(run_id, state):
                pass
            else:
                state = self._build(run_id, sparse)
            self._runs[run_id] = state
            row = run_from_row((*head[0], state.steps, state.first, state.last, state.wall))
            main = main_metric(row)
            if main is None:
                state.line = None
                return row, None
            return row, self._line(run_id, state, main).summary()

    # -- the run's step figures ---------------------------------------------------------------
    def _build(self, run_id: str, sparse: frozenset[str]) -> _Run:
        self.builds += 1
        metrics: dict[str, _Metric] = {}
        steps, first, last, wall = 0, None, None, None
        for name, n, _lo, hi, w, rank in self._q(_BUILD, (run_id, run_id)):
            if name is None:
                steps, first, last, wall = int(n or 0), _int_or_none(_lo), _int_or_none(hi), w
            elif n:
                metrics[str(name)] = _Metric(hwm=int(hi), rows=int(n), rank=int(rank))
        return _Run(sparse, metrics, steps, first, last, None if wall is None else float(wall), self._clock())

    def _advance(self, run_id: str, state: _Run) -> bool:
        """Read the rows after each metric's mark; ``False`` when the run must be read again in full
        (a count check found rows below a mark that were not read)."""
        if self._clock() - state.verified_at >= self.verify_s:
            for name, kept in state.metrics.items():
                (got,) = self._q(_COUNT_BELOW, (run_id, name, kept.hwm))
                if int(got[0]) != kept.rows:
                    return False
            line = state.line
            if line is not None and line.hwm is not None:
                (got,) = self._q(_COUNT_LINE_BELOW, (run_id, line.metric, line.rank, line.hwm))
                if int(got[0]) != line.rows:
                    return False
            state.verified_at = self._clock()
        old = {name: m.hwm for name, m in state.metrics.items()}
        top = max(old.values(), default=None)
        new_at: dict[int, list[str]] = {}
        for name in self._metric_names(run_id):
            if name in state.sparse:
                continue
            m = state.metrics.get(name)
            rows = self._q(_NEW_STEPS, (run_id, name, -(2**62) - 1 if m is None else m.hwm))
            if not rows:
                continue
            if m is None:
                m = state.metrics[name] = _Metric(hwm=int(rows[0][0]), rows=0, rank=int(rows[0][3]))
            for step, n, w, rank in rows:
                new_at.setdefault(int(step), []).append(name)
                m.rows += int(n)
                m.rank = min(m.rank, int(rank))
                state.wall = float(w) if state.wall is None else max(state.wall, float(w))
            m.hwm = max(m.hwm, int(rows[-1][0]))
        for step in sorted(new_at):
            if top is None or step > top or not self._seen_before(run_id, step, old):
                state.steps += 1
            state.first = step if state.first is None else min(state.first, step)
            state.last = step if state.last is None else max(state.last, step)
        return True

    def _seen_before(self, run_id: str, step: int, marks: dict[str, int]) -> bool:
        """Whether a metric read before this poll (its mark at or past ``step``) has a row at ``step``."""
        names = [name for name, hwm in marks.items() if hwm >= step]
        if not names:
            return False
        sql = (
            f"SELECT 1 FROM metrics WHERE run_id = ? AND metric IN ({', '.join('?' * len(names))}) AND step = ? LIMIT 1"
        )
        return bool(self._q(sql, (run_id, *names, step)))

    # -- the main metric's line ---------------------------------------------------------------
    def _line(self, run_id: str, state: _Run, metric: str) -> _Line:
        m = state.metrics.get(metric)
        if m is not None:
            rank: int | None = m.rank
        else:  # a main metric logged with Tap.log() only (sparse: not among the step metrics)
            got = self._q("SELECT MIN(rank) FROM metrics WHERE run_id = ? AND metric = ?", (run_id, metric))
            rank = None if not got or got[0][0] is None else int(got[0][0])
        undone = self._rolled_back(run_id)
        line = state.line
        if line is None or line.metric != metric or line.rank != rank or line.undone != undone:
            line = state.line = self._read_line(run_id, metric, rank, undone)
            return line
        rows = self._q(_LINE_NEW, (run_id, metric, line.rank, -(2**62) - 1 if line.hwm is None else line.hwm))
        for step, value, wall in rows:
            line.rows += 1
            line.hwm = int(step)
            if any(int(step) in r for r in undone):
                continue
            line.count += 1
            if value is not None:
                line.values += 1
                if _finite(value):
                    v = float(value)
                    line.low = v if line.low is None else min(line.low, v)
                    line.high = v if line.high is None else max(line.high, v)
            line.last = (int(step), value, float(wall))
        return line

    def _read_line(self, run_id: str, metric: str, rank: int | None, undone: tuple[range, ...]) -> _Line:
        line = _Line(metric, -1 if rank is None else rank, undone, None, 0)
        if rank is None:
            return line
        kept, kept_params = _kept_sql(undone)
        key = (run_id, metric, rank)
        inf = (-math.inf, math.inf)
        for tag, a, b, c, d, _ in self._q(
            _LINE_AGG.format(kept=kept), (*inf, *inf, *key, *kept_params, *key, *key, *kept_params)
        ):
            if tag == 0:
                line.count, line.values = int(a), int(b)
                line.low = None if c is None else float(c)
                line.high = None if d is None else float(d)
            elif tag == 1:
                line.rows, line.hwm = int(a), (None if b is None else int(b))
            else:
                line.last = (int(a), b, float(c))
        return line


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)
