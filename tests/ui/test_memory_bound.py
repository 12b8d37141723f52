"""The browser view's memory is bounded whatever the store's size: the ended runs' rows and
summaries within a byte budget (least recently used dropped), the per-rank spread read in pages
keeping one point per bucket, each connection's map of a SQLite store at its budget."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("starlette")

import batchtap.ui.data  # noqa: E402
from batchtap.records import Record, RunInfo  # noqa: E402
from batchtap.sinks.sqlite import SQLite  # noqa: E402
from batchtap.ui.data import RAW_PER_BUCKET, ReadOnlyStore, clean  # noqa: E402
from batchtap.ui.endedruns import EndedRuns, entry_bytes  # noqa: E402


def test_the_ended_runs_kept_stay_within_their_byte_budget() -> None:
    summary = {"id": "xxx", "config": {"k": "v" * 1000}}
    size = entry_bytes(summary)
    kept = EndedRuns(budget=3 * size)
    reads: list[str] = []

    def read(run_id: str) -> tuple[Any, dict[str, Any]]:
        reads.append(run_id)
        return object(), dict(summary, id=run_id)

    for i in range(10):
        kept.get(f"r{i:02d}", ("finished",), ended=True, read=read)  # ids as long as "xxx": same size
        assert kept.bytes <= kept.budget
    assert len(kept) == 3 and kept.evicted == 7 and kept.bytes == 3 * size
    kept.get("r07", ("finished",), ended=True, read=read)  # used: now the most recent
    kept.get("r10", ("finished",), ended=True, read=read)  # drops r08, the least recently used
    assert "r07" in kept and "r08" not in kept and "r09" in kept
    reads.clear()
    kept.get("r08", ("finished",), ended=True, read=read)
    assert reads == ["r08"]  # dropped: read again


def _spread_reference(rows: list[tuple[int, int, float | None]], width: int) -> dict[str, Any]:
    """The per-rank spread computed from every row at once (what the view did before it paged)."""
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
    if len(steps) > RAW_PER_BUCKET * width:
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


@pytest.mark.parametrize("page", [7, 64, 100_000])
def test_the_rank_spread_read_in_pages_equals_one_read_of_every_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: int
) -> None:
    rng = random.Random(3)
    rows: list[tuple[int, int, float | None]] = []
    for step in range(0, 700):
        for rank in range(4):
            if rng.random() < 0.1:
                continue  # a rank that stored nothing at this step
            v = rng.random()
            v = None if v < 0.03 else (math.inf if v > 0.995 else round(v, 3))  # NaN, inf, ties
            rows.append((step, rank, v))
    sink = SQLite(tmp_path / "r.db")
    sink.start_run(RunInfo("rk", "ranks", {}, started_at=0.0, world_size=4))
    by_key: dict[tuple[int, int], Record] = {}
    for s, r, v in rows:
        by_key[(s, r)] = Record(
            "rk",
            step=s,
            epoch=0,
            batch=s,
            rank=r,
            wall_time=float(s),
            values={"step_time": math.nan if v is None else v},
        )
    sink.write(list(by_key.values()))
    sink.close()
    monkeypatch.setattr(batchtap.ui.data, "RANK_PAGE", page)
    store = ReadOnlyStore(tmp_path / "r.db")
    try:
        for width in (10, 100, 400):  # 700 steps: decimated at 10 and 100, every step at 400
            before = store.rows_read
            got = store.rank_spread("rk", "step_time", width=width)
            assert got == _spread_reference(rows, width)
            # each row read once, but a page's last step (at most 4 rows) again with the next page
            assert store.rows_read - before <= len(rows) * page / (page - 4) + 1
    finally:
        store.close()


def test_each_connection_maps_at_most_its_budget_of_the_store(tmp_path: Path) -> None:
    sink = SQLite(tmp_path / "m.db")
    sink.start_run(RunInfo("mm", "m", {}, started_at=0.0))
    sink.close()
    for budget in (0, 1 << 20):
        store = ReadOnlyStore(tmp_path / "m.db", mmap_bytes=budget)
        try:
            assert store._all("PRAGMA mmap_size") == [(budget,)]
        finally:
            store.close()
    store = ReadOnlyStore(tmp_path / "m.db")
    try:
        assert store._all("PRAGMA mmap_size") == [(batchtap.ui.data.MMAP_BYTES,)]
    finally:
        store.close()
