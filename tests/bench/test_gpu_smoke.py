"""``bench/gpu.py --device cpu --quick`` runs end to end and prints its one table.

A smoke test of the benchmark script, not a benchmark: it asserts on the table's shape (every
workload x variant row present, numbers where numbers belong), never on times.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ("digits-cnn", "cnn32-w16", "mlp-d12")
VARIANTS = (
    "bare",
    "per-step .item()",
    "batchtap (default metrics, no sink)",
    "batchtap + SQLite + TensorBoard sinks",
    "Lightning + TorchMetrics + CSV",
    "HF-style (log every 10)",
)
NUMBER = re.compile(r"^\d+\.\d+$")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_gpu_bench_quick_on_cpu_prints_its_table() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"bench/gpu.py failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    out = done.stdout
    assert "## batchtap and its peers on CPU" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("| workload | variant |"))
    width = len(_cells(header))
    rows = {(c[0], c[1].split(" (skipped")[0]): c for c in map(_cells, lines) if c and c[0] in WORKLOADS}
    for workload in WORKLOADS:
        for variant in VARIANTS:
            cells = rows.get((workload, variant))
            assert cells is not None, f"no row for {workload} / {variant} in:\n{out}"
            assert len(cells) == width, cells
            if "skipped" in " ".join(cells):  # an optional package (lightning, a sink) is absent
                continue
            ms, ratio, reads = cells[2], cells[4], cells[5]
            assert NUMBER.match(ms) and NUMBER.match(ratio) and NUMBER.match(reads), cells
        # the referee counts what it should: the bare loop reads nothing, the recipe twice a step
        assert rows[(workload, "bare")][5] == "0.00"
        assert rows[(workload, "per-step .item()")][5] == "2.00"
