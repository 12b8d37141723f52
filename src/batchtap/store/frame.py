"""A stored run as a wide pandas ``DataFrame`` indexed by step (``Store.frame``).

pandas is optional (``pip install 'batchtap[pandas]'``): it is imported when a frame is asked for,
never when the store is opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from batchtap._optional import require
from batchtap.records import METRIC_PREFIX
from batchtap.store.errors import StoreError

__all__ = ["run_frame", "RunSource", "POSITION_COLUMNS", "CLASH_PREFIX"]

#: Columns ``frame(..., positions=True)`` adds in front of the metric values.
POSITION_COLUMNS = ("epoch", "batch", "wall_time")
#: Put in front of a metric name that equals a position column (``tap.log({"epoch": 3})``), as the
#: CSV sink does, so neither hides the other.
CLASH_PREFIX = METRIC_PREFIX


class RunSource(Protocol):
    """What a frame is read from: the reader's :class:`~batchtap.store.Store` (named here by what it
    does, so that this module, which the reader imports, imports nothing of the reader)."""

    def run(self, ref: str, /) -> Any: ...
    def metric_names(self, run: str, /) -> list[str]: ...
    def sparse_names(self, run: str, /) -> list[str]: ...
    def series(self, run: str, metric: str, /, rank: int | None = None) -> Sequence[Any]: ...
    def rolled_back(self, run: str, /) -> tuple[range, ...]: ...


def run_frame(
    store: RunSource,
    run: Any,
    metrics: Sequence[str] | None = None,
    *,
    rank: int | None = None,
    positions: bool = False,
    rolled_back: bool = False,
) -> Any:
    """See :meth:`batchtap.store.Store.frame` (this is its implementation); ``run`` is a name, an id
    or a prefix of one, or a ``RunRow``."""
    pd = require("pandas", extra="pandas", purpose="batchtap.store.Store.frame")
    row = store.run(run) if isinstance(run, str) else run
    present = store.metric_names(row.id)
    if isinstance(metrics, str):
        metrics = [metrics]  # a lone name, not its characters
    names = list(present) if metrics is None else list(dict.fromkeys(metrics))
    missing = [m for m in names if m not in present]
    if missing:
        raise StoreError(
            f"run {row.name!r} ({row.id[:8]}) has no values for {', '.join(map(repr, missing))}; it has "
            f"{', '.join(present) or 'none'}; fix: pass metrics= from those (or None for all)"
        )
    sparse = set(store.sparse_names(row.id))
    columns: dict[str, Any] = {}
    where: dict[int, tuple[int, int, float]] = {}  # step -> (epoch, batch, wall_time)
    where_sparse: dict[int, tuple[int, int, float]] = {}
    for name in names:
        points = store.series(row.id, name, rank=rank)
        steps = [p.step for p in points]
        columns[name] = pd.Series([p.value for p in points], index=pd.Index(steps, dtype="int64"), dtype="float64")
        if positions:
            # A step's position comes from its step values; a step with only tap.log() values
            # takes the position that call was given.
            target = where_sparse if name in sparse else where
            for p in points:
                target.setdefault(p.step, (p.epoch, p.batch, p.wall_time))
    frame = pd.DataFrame(columns, columns=names) if columns else pd.DataFrame(index=pd.Index([], dtype="int64"))
    frame = frame.sort_index()
    frame.index.name = "step"
    undone = store.rolled_back(row.id)
    if undone and not rolled_back:
        # The kept trajectory: a rollback's undone steps are what the model no longer is.
        drop = frame.index.isin([s for r in undone for s in r])
        frame = frame[~drop]
    if positions:
        taken = {name for name in names if name in POSITION_COLUMNS}
        frame = frame.rename(columns={name: CLASH_PREFIX + name for name in taken})
        pos = [where.get(int(s)) or where_sparse[int(s)] for s in frame.index]
        for i, col in enumerate(POSITION_COLUMNS):
            dtype = "float64" if col == "wall_time" else "int64"
            frame.insert(i, col, pd.Series([p[i] for p in pos], index=frame.index, dtype=dtype))
    frame.attrs.update(
        run_id=row.id,
        run_name=row.name,
        sparse=[n for n in names if n in sparse],
        rolled_back=[(r.start, r.stop - 1) for r in undone],
    )
    return frame
