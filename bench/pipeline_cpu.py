"""CPU time of the pipeline thread per captured row, next to the training thread's per step.

The pipeline thread shares the training process's GIL (and, here, the machine's two cores): every
microsecond it spends decoding and validating a row is one the training thread may wait for. This
drives ``tap.step()`` in a tight loop on fixed CPU tensors with no sink (so only batchtap's own
work is measured) and reads each thread's CPU clock (``time.thread_time``): the pipeline's
around each item it handles, the training thread's around the loop.

Run: ``.venv/bin/python bench/pipeline_cpu.py`` (about a minute); ``--quick`` for a smoke run.
Compare two commits side by side with ``PYTHONPATH=<snapshot>/src`` (see BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import batchtap as bt
from batchtap.pipeline.transport import thread as thread_pipeline


def _metrics(kind: str) -> list[bt.metrics.Metric]:
    if kind == "loss only":
        return [bt.metrics.Loss()]
    return [
        bt.metrics.Loss(),
        bt.metrics.Accuracy(),
        bt.metrics.StepTime(),
        bt.metrics.DataTime(),
        bt.metrics.Throughput(),
    ]


def measure(kind: str, flush_every: int, steps: int) -> tuple[float, float]:
    """(training thread µs per step, pipeline thread µs per row) for one run."""
    spent = [0.0]
    handle: Callable[..., Any] = thread_pipeline.ThreadPipeline._handle

    def timed(self: thread_pipeline.ThreadPipeline, item: object) -> None:
        start = time.thread_time()
        try:
            handle(self, item)
        finally:
            spent[0] += time.thread_time() - start

    thread_pipeline.ThreadPipeline._handle = timed  # type: ignore[method-assign]
    try:
        outputs, targets = torch.randn(32, 10), torch.randint(0, 10, (32,))
        targets[:4] = -100  # some padding, as an LM batch has
        loss = torch.tensor(0.7)
        inputs = {"loss": loss} if kind == "loss only" else {"loss": loss, "outputs": outputs, "targets": targets}
        tap = bt.Tap(metrics=_metrics(kind), sinks=[], flush_every=flush_every)
        with tap, tap.run(name="pipeline-cpu"):
            start = time.thread_time()
            for _ in range(steps):
                tap.step(**inputs)
            train = time.thread_time() - start
        return train / steps * 1e6, spent[0] / steps * 1e6
    finally:
        thread_pipeline.ThreadPipeline._handle = handle  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000, help="steps per run (default 20000)")
    parser.add_argument("--reps", type=int, default=3, help="runs per row, medians reported (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, one rep")
    args = parser.parse_args(argv)
    steps, reps = (400, 1) if args.quick else (args.steps, args.reps)
    torch.set_num_threads(1)
    print(f"tap.step() in a tight loop, CPU, no sink; {steps} steps per run, {reps} runs, medians\n")
    print("| metrics | flush_every | training thread, µs CPU per step | pipeline thread, µs CPU per row |")
    print("|---|---|---|---|")
    for kind in ("default", "loss only"):
        for flush_every in (50, 200):
            runs = [measure(kind, flush_every, steps) for _ in range(reps)]
            train = statistics.median(r[0] for r in runs)
            pipeline = statistics.median(r[1] for r in runs)
            print(f"| {kind} | {flush_every} | {train:.1f} | {pipeline:.1f} |", flush=True)


if __name__ == "__main__":
    main()
