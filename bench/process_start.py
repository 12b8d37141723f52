"""How long a run takes to start and to finish with the process pipeline, next to the thread pipeline.

A run's start is ``Tap(...)`` plus entering ``tap.run()`` (which waits until the pipeline stored
the run's start); its finish is leaving ``tap.run()`` (every step stored) plus ``tap.close()``. In
between, a few steps of a loss on the CPU. The sink is SQLite in a temporary directory. This script
imports torch at the top, as a training script does (a spawned process that ran the script's
imports would load torch too).

Run: ``.venv/bin/python bench/process_start.py`` (about a minute); ``--quick`` for a smoke run.
Compare two commits side by side with ``PYTHONPATH=<snapshot>/src`` (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import batchtap as bt


def measure(pipeline: str, steps: int, directory: Path, index: int, gap: float = 0.0) -> tuple[float, float]:
    """(seconds to start a run, seconds to finish it and close) for one Tap; ``gap`` seconds of
    other work (a model being built) between ``Tap(...)`` and the run, not counted."""
    loss = torch.tensor(0.5)
    started = time.perf_counter()
    tap = bt.Tap(
        metrics=[bt.metrics.Loss()], sinks=[bt.sinks.SQLite(directory / f"{pipeline}{index}.db")], pipeline=pipeline
    )
    if gap:
        time.sleep(gap)
        started += gap
    run = tap.run(name=f"start-{pipeline}-{index}")
    run.__enter__()
    start = time.perf_counter() - started
    for _ in range(steps):
        tap.step(loss)
    ending = time.perf_counter()
    run.__exit__(None, None, None)
    tap.close()
    return start, time.perf_counter() - ending


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="runs per pipeline, medians reported (default 7)")
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between Tap() and the run (default 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: one rep each")
    args = parser.parse_args(argv)
    reps = 1 if args.quick else args.reps
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        measure("thread", 2, directory, -1)  # the first Tap imports the rest of batchtap: not counted
        cases = [(p, g) for g in (0.0, args.gap) for p in ("thread", "process")]
        results: dict[tuple[str, float], list[tuple[float, float]]] = {case: [] for case in cases}
        for index in range(reps):  # alternating, so that a slow moment of the machine hits every case
            for pipeline, gap in cases:
                results[pipeline, gap].append(measure(pipeline, args.steps, directory, index, gap))
    print(f"Tap + run start, {args.steps} steps of a loss on the CPU, run end + close; SQLite; {reps} runs, medians\n")
    print("| pipeline | s between Tap() and run (not counted) | Tap + run start, s | run end + close, s |")
    print("|---|---|---|---|")
    for (pipeline, gap), runs in results.items():
        start = statistics.median(r[0] for r in runs)
        finish = statistics.median(r[1] for r in runs)
        print(f"| {pipeline} | {gap:g} | {start:.3f} | {finish:.3f} |", flush=True)


if __name__ == "__main__":
    main()
