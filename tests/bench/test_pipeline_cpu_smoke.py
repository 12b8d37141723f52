"""``bench/pipeline_cpu.py --quick`` runs end to end and prints a row per metrics set and flush
interval. A smoke test of the benchmark script: it checks the rows have numbers, never the times."""

from __future__ import annotations

import re

from tests.bench._quick import run_quick


def test_pipeline_cpu_bench_quick_prints_its_rows() -> None:
    stdout = run_quick("pipeline_cpu.py")
    rows = [
        [x.strip() for x in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith("| default") or line.startswith("| loss only")
    ]
    assert [(r[0], r[1]) for r in rows] == [
        ("default", "50"),
        ("default", "200"),
        ("loss only", "50"),
        ("loss only", "200"),
    ]
    for row in rows:
        assert re.fullmatch(r"\d+\.\d", row[2]) and re.fullmatch(r"\d+\.\d", row[3]), row
