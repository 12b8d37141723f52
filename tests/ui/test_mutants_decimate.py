"""The UI's line cache (``ui/decimate.py``) at exactly its point budget: a slip a sampled mutation run
over issue 38's files let through the other UI tests (TESTING.md, "third session")."""

from __future__ import annotations

from batchtap.ui.decimate import LineCache


def _line(points: int) -> dict[str, list[float]]:
    return {"step": list(range(points)), "value": [0.0] * points}


def test_lines_filling_the_budget_exactly_are_all_kept_and_one_more_point_drops_the_oldest() -> None:
    cache = LineCache(points=10)
    cache.get("a", lambda: _line(4), keep=True)
    cache.get("b", lambda: _line(6), keep=True)
    assert len(cache) == 2  # 4 + 6 points: exactly the budget
    assert cache.get("a", lambda: _line(99), keep=True) == _line(4)  # a hit, not recomputed
    assert (cache.hits, cache.misses) == (1, 2)
    cache.get("c", lambda: _line(1), keep=True)  # 11 points: the least recently used (b) goes
    assert len(cache) == 2
    assert cache.get("b", lambda: _line(6), keep=True) == _line(6)
    assert cache.misses == 4
