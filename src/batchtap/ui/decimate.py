"""Min/max decimation inside the database, and decimated lines kept in the server's memory.

A line of ``n`` steps shown on ``width`` pixels is cut into buckets of equal step span; each bucket
comes back from the database as its minimum, maximum and mean (and the wall time of its first row),
so a one-step spike survives and only ~``width`` rows cross into Python instead of ``n``.

* **SQLite**: one statement per line. A recursive CTE lists the buckets' first steps and, per
  bucket, a correlated aggregate reads that bucket's rows as one range of the primary key
  ``(run_id, metric, step, rank)``: the rows are read once, in key order, with no temporary B-tree
  (a ``GROUP BY`` on a step expression sorts all ``n`` rows first: ~2x slower here). A scalar
  subquery returns one value, so the bucket's three aggregates travel as one text of three
  ``%!.17g`` numbers; SQLite formats a double exactly that way up to ~1e±150, so a bucket whose
  numbers are larger is read again as plain ``REAL``s (rare: values that big are near overflow).
  One statement also means one ``execute``: the GIL is released for the whole scan, and parallel
  requests do not queue behind each other's Python loops.
* **PostgreSQL**: one ``GROUP BY (step - first) / bucket`` over the same key range (its hash
  aggregate reads the rows once; no sort).

:class:`LineCache` keeps decimated lines of runs that are no longer running (their rows do not
change), reads a line asked for by several requests at once only once, and lets at most
:data:`SCANS_AT_ONCE` decimations scan at the same time.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

__all__ = [
    "Bucket",
    "SQLITE_BUCKETS",
    "POSTGRES_BUCKETS",
    "SQLITE_ONE_BUCKET",
    "EXACT_TEXT_LIMIT",
    "parse_sqlite_bucket",
    "needs_exact_read",
    "LineCache",
    "SCANS_AT_ONCE",
    "CACHE_POINTS",
    "points_of",
    "clean",
    "columns",
    "minmax_columns",
]

#: One bucket: (first step of the bucket, min, max, mean, wall time of its first row).
Bucket = tuple[int, float, float, float, float]

# ?1 first step, ?2 steps per bucket, ?3 last step, ?4 run, ?5 metric, ?6 rank. Both subqueries
# search the primary key by (run_id, metric, step range) and test rank on the rows found.
SQLITE_BUCKETS = """
WITH RECURSIVE b(lo) AS (SELECT ?1 UNION ALL SELECT lo + ?2 FROM b WHERE lo + ?2 <= ?3)
SELECT lo,
  (SELECT CASE WHEN MIN(value) IS NULL THEN NULL
               ELSE printf('%!.17g %!.17g %!.17g', MIN(value), MAX(value), AVG(value)) END
     FROM metrics WHERE run_id = ?4 AND metric = ?5 AND rank = ?6 AND step >= lo AND step < lo + ?2 AND step <= ?3),
  (SELECT wall_time
     FROM metrics WHERE run_id = ?4 AND metric = ?5 AND rank = ?6 AND step >= lo AND step < lo + ?2 AND step <= ?3
     ORDER BY step LIMIT 1)
FROM b
"""

#: One bucket's aggregates as ``REAL`` s (the exact re-read of a bucket past :data:`EXACT_TEXT_LIMIT`).
SQLITE_ONE_BUCKET = (
    "SELECT MIN(value), MAX(value), AVG(value) FROM metrics"
    " WHERE run_id = ? AND metric = ? AND rank = ? AND step >= ? AND step <= ?"
)

# Written with ? and rendered by the PostgreSQL dialect; ?1 first step, ?2 steps per bucket.
# Not AVG(value): PostgreSQL's float8 average also sums the squares and raises "value out of
# range: overflow" past ~1e154. Each value divided by the bucket's step count first cannot
# overflow a finite sum (the bucket holds at most that many values); the mean is
# SUM(value / bucket) * bucket / COUNT(value), taken in Python.
POSTGRES_BUCKETS = (
    "SELECT (step - ?) / ? AS b, MIN(value), MAX(value), SUM(value / ?), COUNT(value), MIN(wall_time) FROM metrics"
    " WHERE run_id = ? AND metric = ? AND rank = ? AND step >= ? AND step <= ? GROUP BY b ORDER BY b"
)

#: SQLite's ``printf('%!.17g')`` gives back the exact double below this magnitude (checked with
#: SQLite 3.40 on 40,000 random doubles up to 1e±100: all exact; of 40,000 up to 1e±300, 42 were
#: one unit in the last place off), so larger finite numbers are read again.
EXACT_TEXT_LIMIT = 1e100

#: Points of decimated lines kept in memory, all lines together (a point is six numbers, ~220 B
#: as Python objects, measured: ~110 MB at most). A run page of 7 lines at 643 px holds ~9,000.
CACHE_POINTS = 500_000
#: Decimations that may scan a line's rows at the same time: one run page's lines at once (a
#: scan releases the GIL, so they share the cores), but not every line of a many-run comparison.
SCANS_AT_ONCE = 8


def parse_sqlite_bucket(text: str | None) -> tuple[float, float, float] | None:
    """The (min, max, mean) of a bucket from :data:`SQLITE_BUCKETS`' text; ``None`` for a bucket
    with no value (no rows, or NaN only: stored as SQL NULL).

    Example:
        >>> parse_sqlite_bucket("0.5 50 1.25"), parse_sqlite_bucket(None)
        ((0.5, 50.0, 1.25), None)
    """
    if text is None:
        return None
    low, high, mean = (float(x) for x in text.split(" "))
    return low, high, mean


def needs_exact_read(numbers: Sequence[float]) -> bool:
    """Whether a bucket's numbers are past where SQLite's text of a double is exact.

    Example:
        >>> needs_exact_read((1.0, 2e200, 3.0)), needs_exact_read((1.0, float("inf"), 3.0))
        (True, False)
    """
    return any(math.isfinite(x) and abs(x) >= EXACT_TEXT_LIMIT for x in numbers)


def points_of(line: Any) -> int:
    """How many points a line (the columns of :func:`batchtap.ui.data.ReadOnlyStore.series`) holds.

    Example:
        >>> points_of({"step": [0, 9], "value": [1.0, 2.0]}), points_of("other")
        (2, 1)
    """
    return len(line["step"]) if isinstance(line, dict) and "step" in line else 1


class LineCache:
    """Decimated lines by key, least recently used dropped first, computed once even when asked
    for by several requests at the same time.

    Args:
        points: how many points (:func:`points_of`) the lines kept may hold together.
        scans: decimations allowed to run at the same time (cached or not).
    """

    def __init__(self, points: int = CACHE_POINTS, scans: int = SCANS_AT_ONCE) -> None:
        self._budget = points
        self._points = 0
        self._lines: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._running: dict[Hashable, threading.Event] = {}
        self._lock = threading.Lock()
        self._scans = threading.BoundedSemaphore(scans)
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lines)

    def get(self, key: Hashable, compute: Callable[[], Any], *, keep: bool) -> Any:
        """The line for ``key``: from memory, or ``compute()`` (kept when ``keep``).

        ``keep=False`` (a running run: its rows still change) computes every time and keeps nothing.
        """
        if not keep:
            with self._scans:
                return compute()
        while True:
            with self._lock:
                if key in self._lines:
                    self._lines.move_to_end(key)
                    self.hits += 1
                    return self._lines[key]
                running = self._running.get(key)
                if running is None:
                    running = self._running[key] = threading.Event()
                    break
            running.wait()  # the same line is being read by another request: use its result
        try:
            with self._scans:
                value = compute()
            with self._lock:
                self.misses += 1
                self._lines[key] = value
                self._points += points_of(value)
                while self._points > self._budget and len(self._lines) > 1:
                    self._points -= points_of(self._lines.popitem(last=False)[1])
            return value
        finally:
            with self._lock:
                del self._running[key]
            running.set()

    def clear(self) -> None:
        """Forget every line."""
        with self._lock:
            self._lines.clear()
            self._points = 0


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


def columns(mode: str, rank: int, rows: Sequence[tuple[Any, ...]], bucket: int) -> dict[str, Any]:
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


def minmax_columns(rank: int, buckets: Sequence[Bucket], bucket: int, last_step: int) -> dict[str, Any]:
    """Each bucket as two points, its minimum at its first step and its maximum at its last (a
    bucket is at most a pixel wide, so where inside it they fall does not show); both carry the
    bucket's step span, mean and the wall time of its first row. A bucket of NaN values only has
    no point (the buckets leave it out): the anomaly markers show its steps."""
    rows = []
    for b0, low, high, mean, wall in buckets:
        b1 = min(b0 + bucket - 1, last_step)
        rows += [(b0, low, wall, b0, b1, mean), (b1, high, wall, b0, b1, mean)]
    return columns("minmax", rank, rows, bucket)
