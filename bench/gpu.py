"""batchtap and its peers on a GPU, in one script that fits 8 minutes on one GPU (issue 7).

The variants of ``peers.py`` (bare, per-step ``.item()``, batchtap, batchtap + SQLite + TensorBoard,
Lightning + TorchMetrics + CSV, HF-style) on three CUDA workloads: the demo's ``DigitsCNN`` on
digits, the 3-block CNN of ``peers.py``, and a launch-bound MLP (~1 ms/step: tiny kernels, so the
host's launch queue is what a per-step sync empties). Every batchtap run (timed, counted and NaN)
runs under ``torch.cuda.set_sync_debug_mode("error")``: an implicit sync in its step path raises and
is reported in the table instead of a time. An ``nvidia-smi`` snapshot is printed when the tool is
present.

Runs:
    .venv/bin/python bench/gpu.py                      # CUDA, the full table (< 8 min on one GPU)
    .venv/bin/python bench/gpu.py --device cpu --quick # end-to-end smoke run on the CPU (the test suite's)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _harness as H
import torch

_SMI_QUERY = (
    "name,driver_version,memory.total,memory.used,utilization.gpu,temperature.gpu,clocks.sm,clocks.max.sm,power.draw"
)


def nvidia_smi() -> str:
    """A one-line-per-GPU snapshot, or why there is none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi: not found (no NVIDIA driver tools on PATH); snapshot skipped"
    try:
        done = subprocess.run(
            [exe, f"--query-gpu={_SMI_QUERY}", "--format=csv"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi: failed ({exc}); snapshot skipped"
    if done.returncode != 0:
        return f"nvidia-smi: exit {done.returncode}: {done.stderr.strip()[:200]}; snapshot skipped"
    return "nvidia-smi:\n" + done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke run)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per run (default 400)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per run (default 20)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 rep of a few steps, short NaN runs")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "bench/gpu.py: CUDA is not available here; run `bench/gpu.py --device cpu --quick` for the "
            "CPU smoke run, or run this on a machine with a GPU",
            file=sys.stderr,
        )
        return 2
    nan_epoch = None
    if args.quick:
        args.reps, args.steps, args.warmup, nan_epoch = 1, 5, 2, 8
    if device.type == "cpu":
        torch.set_num_threads(1)  # as peers.py: the other core is left to the pipeline thread
    started = time.perf_counter()

    workloads = [H.digits_workload(device), H.cnn32_workload(device), H.mlp_workload(device)]
    steps = {wl.name: args.steps for wl in workloads}
    variants = H.peer_variants()
    rows = H.run_suite(
        workloads,
        variants,
        reps=args.reps,
        steps=steps,
        warmup=args.warmup,
        count_steps=min(args.steps, 100),
        nan_at=5,
        nan_epoch_len=nan_epoch,
        sync_debug_for=lambda v: isinstance(v, H.Batchtap),
    )
    smi = nvidia_smi() if device.type == "cuda" else "nvidia-smi: not queried (CPU run)"

    print()
    print(f"## batchtap and its peers on {device.type.upper()} (bench/gpu.py{' --quick' if args.quick else ''})")
    print()
    for line in H.machine_lines(device):
        print(line)
    print(smi)
    for wl in workloads:
        epoch = nan_epoch or wl.epoch_len
        print(
            f"{wl.name}: {wl.description}; {steps[wl.name]} timed steps (+{args.warmup} warm-up); "
            f"NaN runs: epochs of {epoch} batches"
        )
    print(f"{args.reps} interleaved reps; medians")
    print()
    print(H.format_table(rows, nan_at=5, extra=("sync_debug",)))
    print()
    elapsed = time.perf_counter() - started
    print(f"(total bench time {elapsed:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
