"""tap.step()'s host cost with bt.metrics.System beside the default metrics, and without it, side by
side (issue 27: System must add nothing to the step but a host clock read; its sampling thread runs
at 10 Hz beside the loop). The stepcost method (../shared/tools/stepcost.py): fixed CPU tensors, the
median of 5,000 calls, in units of one tiny eager op; repetitions alternate the two set-ups.

    .venv/bin/python bench/system_cost.py [--reps 5]

System samples psutil here (gpu=False: no GPU on this machine; with NVML the training thread does the
same clock read, NVML's calls run on the sampling thread).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import batchtap as bt


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    a, b = torch.randn(1), torch.randn(1)
    kw = {"loss": torch.tensor(0.7), "outputs": torch.randn(32, 10), "targets": torch.randint(0, 10, (32,))}

    def cost(system: bool) -> float:
        metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(), bt.metrics.StepTime(), bt.metrics.DataTime()]
        metrics.append(bt.metrics.Throughput())
        if system:
            metrics.append(bt.metrics.System(gpu=False))
        tap = bt.Tap(metrics=metrics, sinks=[], flush_every=50)
        with tap, tap.run(name="cost"):
            for _ in range(300):
                tap.step(**kw)
            return _median_us(lambda: tap.step(**kw), 5000)

    rows = []
    for _ in range(args.reps):
        op = _median_us(lambda: torch.add(a, b), 5000)
        rows.append((op, cost(False), cost(True)))
    op = statistics.median(r[0] for r in rows)
    without = statistics.median(r[1] for r in rows)
    with_system = statistics.median(r[2] for r in rows)
    print("| set-up | tap.step() median (us) | tiny ops |")
    print("|---|---|---|")
    print(f"| default metrics | {without:.1f} | {without / op:.1f} |")
    print(f"| default metrics + System (psutil thread at 10 Hz) | {with_system:.1f} | {with_system / op:.1f} |")
    print(f"\ntiny op {op:.2f} us; {args.reps} alternating repetitions, medians")


if __name__ == "__main__":
    main()
