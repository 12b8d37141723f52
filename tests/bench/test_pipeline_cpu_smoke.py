"""``bench/pipeline_cpu.py --quick`` runs end to end and prints a row per metrics set and flush
interval. A smoke test of the benchmark script: it checks the rows have numbers, never the times."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_cpu_bench_quick_prints_its_rows() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pipeline_cpu.py"), "--quick"],
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"bench/pipeline_cpu.py failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    rows = [
        [x.strip() for x in line.strip("|").split("|")]
        for line in done.stdout.splitlines()
        if line.startswith("| default") or line.startswith("| loss only")
    ]
    assert [(r[0], r[1]) for r in rows] == [("default", "50"), ("default", "200"), ("loss only", "50"), ("loss only", "200")]
    for row in rows:
        assert re.fullmatch(r"\d+\.\d", row[2]) and re.fullmatch(r"\d+\.\d", row[3]), row
