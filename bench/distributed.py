"""Cost of batchtap under DDP: 2 gloo processes on this machine, bare loop vs batchtap, interleaved.

    .venv/bin/python bench/distributed.py [--reps 5] [--steps 60] [--flush-every 50]

Each of the 2 ranks trains the same CNN under ``DistributedDataParallel`` (gloo, CPU). Per repetition
both variants run (order rotated), each for ``--steps`` timed steps after a warm-up:

* ``bare``: the DDP loop;
* ``batchtap``: the same loop with ``tap.step(loss, outputs, targets)`` and the default metrics.

Reported (rank 0's view, medians over repetitions):

* ms/step of each variant and the ratio batchtap / bare (per repetition, then the median);
* the collective cost per flush on the training thread: at every flush step batchtap completes the
  previous flush's stop-agreement all-reduce and issues the next one (``async_op=True`` on its own
  gloo group), timed around that whole call, and that cost amortised per step (divided by the flush
  interval);
* the per-flush exchange of the block on the pipeline thread (``all_gather_object`` of the packed
  rows), which runs beside training, not in it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import batchtap as bt
import batchtap.tap as tap_module
from batchtap.pipeline.chain.reduce import Reducer


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10),
    )


class _Timer:
    """Accumulates wall time of wrapped calls."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - started)

        return timed


def _run(
    variant: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: list,
    steps: int,
    flush_every: int,
    agree: _Timer,
    exchange: _Timer,
) -> float:
    tap = None
    if variant == "batchtap":
        tap = bt.Tap(sinks=[], flush_every=flush_every)
        tap._agree = agree.wrap(tap._agree)  # type: ignore[method-assign]
    durations = []
    with tap if tap is not None else _Null(), tap.run() if tap is not None else _Null():
        for i in range(steps + 10):
            x, y = data[i % len(data)]
            started = time.perf_counter()
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if tap is not None:
                tap.step(loss=loss, outputs=out, targets=y)
            if i >= 10:
                durations.append(time.perf_counter() - started)
    return statistics.median(durations)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 ranks share this machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(8)]
    agree, exchange = _Timer(), _Timer()
    original_reduce = Reducer.reduce
    Reducer.reduce = exchange.wrap(original_reduce)  # type: ignore[method-assign]
    # Of the agreement call, the part that issues the next all-reduce (batchtap's only async_op
    # all_reduce; DDP's gradient buckets go through its C++ reducer, not this function).
    issue = _Timer()
    all_reduce = issue.wrap(dist.all_reduce)
    tap_module.dist.all_reduce = all_reduce  # type: ignore[attr-defined]
    results: dict[str, list[float]] = {"bare": [], "batchtap": []}
    for rep in range(args.reps):
        order = ["bare", "batchtap"] if rep % 2 == 0 else ["batchtap", "bare"]
        for variant in order:
            dist.barrier()
            results[variant].append(_run(variant, model, opt, data, args.steps, args.flush_every, agree, exchange))
    if rank == 0:
        ratios = [b / a for a, b in zip(results["bare"], results["batchtap"])]
        Path(out).write_text(
            json.dumps(
                {
                    "bare_ms": statistics.median(results["bare"]) * 1e3,
                    "batchtap_ms": statistics.median(results["batchtap"]) * 1e3,
                    "ratio": statistics.median(ratios),
                    "ratios": ratios,
                    "agree_us": statistics.median(agree.times) * 1e6 if agree.times else float("nan"),
                    "agree_n": len(agree.times),
                    "agree_spread_us": _spread(agree.times),
                    "issue_us": statistics.median(issue.times) * 1e6 if issue.times else float("nan"),
                    "exchange_us": statistics.median(exchange.times) * 1e6 if exchange.times else float("nan"),
                    "flush_every": args.flush_every,
                }
            )
        )
    dist.destroy_process_group()


def _spread(times: list[float]) -> list[float]:
    """min, 10th, 50th, 90th percentile and max, in µs."""
    if len(times) < 2:
        return [t * 1e6 for t in times]
    cuts = statistics.quantiles(times, n=10, method="inclusive")
    return [min(times) * 1e6, cuts[0] * 1e6, statistics.median(times) * 1e6, cuts[-1] * 1e6, max(times) * 1e6]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--flush-every", type=int, default=10)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "dist.json")
    mp.spawn(_worker, args=(2, port, args, out), nprocs=2, join=True)
    r = json.loads(Path(out).read_text())
    print(
        f"bench/distributed.py: 2 gloo ranks, DDP CNN on 32x32, {args.reps} reps x {args.steps} steps, "
        f"flush every {r['flush_every']} steps; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    print("| variant | ms/step (median) | ratio to bare |")
    print("|---|---|---|")
    print(f"| DDP bare | {r['bare_ms']:.2f} | 1.000 |")
    print(f"| DDP + batchtap (default metrics) | {r['batchtap_ms']:.2f} | {r['ratio']:.3f} |")
    print()
    print("| per flush | median |")
    print("|---|---|")
    print(
        f"| stop agreement (complete previous + issue next all-reduce), training thread | {r['agree_us']:.0f} µs "
        f"({r['agree_us'] / r['flush_every']:.1f} µs/step amortised; {r['agree_n']} flushes) |"
    )
    print(f"| of which issuing the next all-reduce (`async_op=True`) | {r['issue_us']:.0f} µs |")
    print(
        f"| block exchange + reduction, pipeline thread (includes waiting for the other rank) | {r['exchange_us']:.0f} µs (beside training) |"
    )
    print(
        "agreement call per flush, µs: min / p10 / median / p90 / max = "
        + " / ".join(f"{x:.0f}" for x in r["agree_spread_us"])
    )
    print(f"per-rep ratios: {', '.join(f'{x:.3f}' for x in r['ratios'])}")


if __name__ == "__main__":
    main()
