"""One rank of ``test_sharded_grad_norm.py``: ``python -m tests.realloops.sharded_worker OUT_DIR``.

Launched as a real process (MASTER_ADDR/PORT, RANK, WORLD_SIZE in the environment, gloo on
loopback), the way torchrun launches it. A ZeRO-2-style data-parallel loop: every rank runs the
full model on its own batch, gradients are averaged over ranks, and each rank keeps (and steps) the
gradients of its own disjoint shard of the parameters only — rank 0 the first half of the parameter
tensors, rank 1 the rest — then broadcasts its updated shard. Writes ``OUT_DIR/rank{R}.json``: what
its sink received and the ``.item()`` references of every step.
"""

from __future__ import annotations

import json
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink

STEPS = 12


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )
    params = list(model.parameters())
    owner = [i * world // len(params) for i in range(len(params))]  # contiguous halves of the layers
    local = [p for p, o in zip(params, owner) if o == rank]
    opt = torch.optim.AdamW(local, lr=1e-2)
    sink = ListSink()
    metrics = [
        bt.metrics.Loss(),
        bt.metrics.Accuracy(),
        bt.metrics.GradNorm(local, sharded=True),
        bt.metrics.StepTime(),
    ]
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    refs = []
    tap = bt.Tap(metrics, [sink], flush_every=5, collective_timeout=60.0)
    with tap, tap.run(name="zero2"):
        for step in range(STEPS):
            n = 6 + 3 * rank + step % 2  # uneven per-rank batches: the loss is sample-weighted over ranks
            x, y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
            for p in params:
                p.grad = None
            outputs = model(x)
            loss = F.cross_entropy(outputs, y)
            loss.backward()
            for p in params:  # average over ranks (a reduce-scatter, written as all_reduce + drop)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world
            full_norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params))
            for p, o in zip(params, owner):
                if o != rank:
                    p.grad = None  # not this rank's shard
            local_norm = torch.nn.utils.clip_grad_norm_(local, math.inf).item()  # no clipping: the norm
            gathered: list = [None] * world
            dist.all_gather_object(gathered, torch.cat([p.grad.flatten() for p in local]))
            opt.step()
            for p, o in zip(params, owner):
                dist.broadcast(p.data, src=o)
            tap.step(loss=loss, outputs=outputs, targets=y)
            stats: list = [None] * world
            dist.all_gather_object(stats, (loss.item(), n, (outputs.argmax(1) == y).sum().item(), local_norm))
            refs.append(
                {
                    "step": step,
                    "shard_sizes": [t.numel() for t in gathered],
                    "gathered_norm": math.sqrt(sum(t.double().pow(2).sum().item() for t in gathered)),
                    "full_norm": full_norm,
                    "rank_norms": [s[3] for s in stats],
                    "loss": sum(s[0] * s[1] for s in stats) / sum(s[1] for s in stats),
                    "accuracy": sum(s[2] for s in stats) / sum(s[1] for s in stats),
                    "grads_held": sum(p.grad is not None for p in params),
                }
            )
    result = {
        "rank": rank,
        "world": world,
        "local_tensors": len(local),
        "records": [
            {"step": r.step, "rank": r.rank, "sparse": r.sparse, "values": dict(r.values)} for r in sink.records
        ],
        "events": [e.to_dict() for e in sink.events],
        "refs": refs,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
