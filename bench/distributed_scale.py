"""What batchtap's cross-rank exchange costs as the world grows: 2, 4, 8 and 16 gloo ranks on
loopback, the fixed-size reduction beside the object all-gather it replaced, in one run.

    .venv/bin/python bench/distributed_scale.py [--worlds 2,4,8,16] [--steps 200] [--flush-every 50]

Each rank trains a tiny linear classifier (no DDP: nothing but batchtap's own traffic crosses the
sockets) with the default metrics plus lr and grad norm, and ``sinks=[]``. Per world size and
exchange (``fixed``: the all_reduce exchange; ``objects``: every rank's pickled rows all-gathered,
the pre-issue-17 design, forced through ``Reducer._exchange_objects``), per rank:

* **sent B/flush** — bytes the process wrote to sockets during the run (``wchar`` of
  ``/proc/self/io``: gloo's sends; nothing else writes: no sinks, no output), divided by the run's
  flushes. On loopback every byte sent is received by another rank, so the mean received per rank
  equals the mean sent; gloo's ring all-reduce is symmetric, so each rank receives what it sends.
* **payload B/flush** — what batchtap handed to collectives (``Reducer.traffic``: tensor bytes plus
  pickled objects), the training thread's 3-float agreement not included.
* **pipeline ms/flush** — median time in ``Reducer.reduce`` on the pipeline thread (the exchange
  and the reduction, waiting for the slowest rank included), beside training.
* **step µs** — median host time of ``tap.step()`` on the training thread.

Reported: rank 0 and the median over ranks. 16 processes share this machine's cores, so the times
grow with oversubscription, not only with the exchange; the byte counts do not depend on load.
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

import batchtap as bt
from batchtap.pipeline.chain.reduce import Reducer


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar:")).split()[1])


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, exchange: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if exchange == "objects":
        Reducer._exchange = lambda self, d, s, t: self._exchange_objects(d, s, t)  # type: ignore[method-assign]
    reduce_times: list[float] = []
    original = Reducer.reduce

    def timed(self: Reducer, *a: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(self, *a)
        finally:
            reduce_times.append(time.perf_counter() - started)

    Reducer.reduce = timed  # type: ignore[method-assign]
    torch.manual_seed(rank)
    model = torch.nn.Linear(16, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(32, 16), torch.randint(0, 10, (32,))) for _ in range(8)]
    tap = bt.Tap(sinks=[], optimizer=opt, model=model, flush_every=args.flush_every)
    step_times: list[float] = []
    with tap:
        run = tap.run(name=f"scale-{world}")
        with run:
            dist.barrier()
            before = _wchar()
            for i in range(args.steps):
                x, y = data[i % len(data)]
                out_ = model(x)
                loss = F.cross_entropy(out_, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                started = time.perf_counter()
                tap.step(loss=loss, outputs=out_, targets=y)
                step_times.append(time.perf_counter() - started)
        sent = _wchar() - before  # the run's end flushed and exchanged the last block
        reducer = tap._last_pipeline_reducer() if hasattr(tap, "_last_pipeline_reducer") else None
    traffic = _traffic(tap)
    flushes = max(traffic.get("flushes", 0), 1)
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "sent_per_flush": sent / flushes,
                "payload_per_flush": traffic.get("payload_bytes", 0) / flushes,
                "collectives_per_flush": traffic.get("collectives", 0) / flushes,
                "flushes": flushes,
                "pipeline_ms": statistics.median(reduce_times) * 1e3 if reduce_times else float("nan"),
                "step_us": statistics.median(step_times[10:]) * 1e6,
            }
        )
    )
    del reducer
    dist.destroy_process_group()


def _traffic(tap: bt.Tap) -> dict[str, int]:
    for reducer in _REDUCERS:
        return dict(reducer.traffic)
    return {}


_REDUCERS: list[Reducer] = []
_init = Reducer.__init__


def _remember(self: Reducer, *a: Any, **k: Any) -> None:
    _init(self, *a, **k)
    _REDUCERS.append(self)


Reducer.__init__ = _remember  # type: ignore[method-assign]


def _one(world: int, exchange: str, args: argparse.Namespace) -> list[dict[str, float]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp()
    mp.spawn(_worker, args=(world, port, args, exchange, out), nprocs=world, join=True)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4,8,16")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--flush-every", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for exchange in ("fixed", "objects"):
            ranks = _one(world, exchange, args)
            med = {k: statistics.median(r[k] for r in ranks) for k in ranks[0]}
            rows.append({"world": world, "exchange": exchange, "rank0": ranks[0], "median": med})
            print(
                f"world {world:2d} {exchange:7s}: sent {ranks[0]['sent_per_flush']:9.0f} B/flush (rank 0), "
                f"{med['sent_per_flush']:9.0f} (median); payload {med['payload_per_flush']:8.0f} B; "
                f"pipeline {med['pipeline_ms']:7.2f} ms/flush; step {med['step_us']:6.1f} us",
                flush=True,
            )
    print()
    print(
        f"bench/distributed_scale.py: gloo on loopback, {args.steps} steps, flush every {args.flush_every}, "
        f"default metrics + lr + grad norm, sinks=[]; torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    print(
        "| ranks | exchange | sent B/flush rank 0 | sent B/flush median rank | payload B/flush | collectives/flush | pipeline ms/flush (median rank) | tap.step µs (median rank) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        r0, med = row["rank0"], row["median"]
        print(
            f"| {row['world']} | {row['exchange']} | {r0['sent_per_flush']:.0f} | {med['sent_per_flush']:.0f} | "
            f"{med['payload_per_flush']:.0f} | {med['collectives_per_flush']:.1f} | {med['pipeline_ms']:.2f} | {med['step_us']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
