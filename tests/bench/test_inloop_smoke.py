"""``bench/inloop.py --quick`` runs end to end and prints its one table.

A smoke test of the benchmark script, not a benchmark: it checks that every call has a row with
numbers in it, never the times themselves.
"""

from __future__ import annotations

import re

from tests.bench._quick import run_quick

CALLS = (
    "tap.step, default metrics",
    "tap.step, loss only",
    "per-step .item() recipe",
    "floor: the default metrics' 3 device ops alone",
)


def test_inloop_bench_quick_prints_a_row_per_call() -> None:
    stdout = run_quick("inloop.py")
    rows = {c[0]: c for c in ([x.strip() for x in line.strip("|").split("|")] for line in stdout.splitlines())}
    for call in CALLS:
        cells = rows.get(call)
        assert cells is not None, f"no row for {call!r} in:\n{stdout}"
        loop_us, alone_us, ratio = cells[1:4]
        assert re.fullmatch(r"\d+\.\d", loop_us) and re.fullmatch(r"\d+\.\d", alone_us), cells
        assert re.fullmatch(r"\d+\.\dx", ratio), cells
