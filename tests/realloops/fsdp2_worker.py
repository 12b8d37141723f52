"""One rank of ``test_fsdp2.py``: ``python -m tests.realloops.fsdp2_worker OUT_DIR``.

Launched as a real process the way torchrun launches it (MASTER_ADDR/PORT, RANK, WORLD_SIZE in the
environment, gloo on loopback). An FSDP2 loop as its documentation writes it: every ``nn.Linear``
and then the model wrapped by ``fully_shard`` (parameters and gradients are ``DTensor`` shards),
AdamW with a hand-set cosine lr, each rank its own batch, ``clip_grad_norm_`` returning a
``DTensor``. The same loop runs once per front-end:

* ``autolog-clip`` / ``autolog`` — ``bt.autolog()`` with and without the clipping call;
* ``tap-dtensor`` — explicit ``bt.Tap(optimizer=)``, ``tap.step(grad_norm=)`` the ``DTensor`` as returned;
* ``tap-full`` — the same with ``grad_norm.full_tensor()``;
* ``tap-computed`` — ``bt.Tap(model=, optimizer=)``: the norm computed by batchtap from the shards;
* ``bare`` / ``bare-tp`` — the loop with no batchtap at all: its host reads per iteration are the baseline;
* ``autolog-tp`` — tensor parallel instead (``parallelize_module``: column- then row-wise sharded
  ``DTensor`` weights, every rank the same batch), under ``bt.autolog()`` with clipping.

Writes ``OUT_DIR/rank{R}.json``: per front-end, what its sink received and the ``.item()``
references of every step (taken after the step, so the run is the same as without them).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from tests.conftest import ListSink

STEPS = 20
BATCH = 8
FRONT_ENDS = ("bare", "bare-tp", "autolog-clip", "autolog", "tap-dtensor", "tap-full", "tap-computed", "autolog-tp")


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _tensor_parallel(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (world,))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _cosine(step: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * step / STEPS))


def run(front_end: str, rank: int, world: int) -> dict:
    tensor_parallel = front_end.endswith("-tp")
    model = _tensor_parallel(world) if tensor_parallel else _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine)
    sink = ListSink()
    clip = front_end not in ("autolog", "tap-computed")  # a computed norm is of the gradients the step used
    tap: bt.Tap | None = None
    context = contextlib.ExitStack()
    if front_end.startswith("bare"):
        pass
    elif front_end.startswith("autolog"):
        bt.autolog(sinks=[sink], name=front_end, optimizers=[opt], flush_every=5)
        context.callback(bt.autolog, enabled=False)
    else:
        model_arg = model if front_end == "tap-computed" else None
        tap = bt.Tap(sinks=[sink], optimizer=opt, model=model_arg, flush_every=5, collective_timeout=60.0)
        context.enter_context(tap)
        context.enter_context(tap.run(name=front_end))
    g = torch.Generator().manual_seed(100 if tensor_parallel else 100 + rank)  # TP: every rank the same batch
    refs = []
    with context:
        for _ in range(STEPS):
            x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
            with HostReadCounter() as reads:  # the loop's own calls, batchtap's hooks inside them
                outputs = model(x)
                loss = F.cross_entropy(outputs, y)
                opt.zero_grad()
                loss.backward()
            step_reads = reads.count
            grads = [p.grad for p in model.parameters()]
            norm = torch.nn.utils.get_total_norm(grads).full_tensor().item()  # before clipping, the global norm
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05) if clip else None
            after = torch.nn.utils.get_total_norm(grads).full_tensor().item() if clip else None  # clipped
            lr = opt.param_groups[0]["lr"]
            with HostReadCounter() as reads:
                opt.step()
                sched.step()
                if tap is not None:
                    passed = (
                        None
                        if front_end == "tap-computed"
                        else total.full_tensor()
                        if front_end == "tap-full"
                        else total
                    )
                    tap.step(loss=loss, outputs=outputs, targets=y, grad_norm=passed)
            step_reads += reads.count
            stats: list = [None] * world
            dist.all_gather_object(stats, (loss.item(), (outputs.argmax(1) == y).sum().item()))
            refs.append(
                {
                    "loss": sum(s[0] for s in stats) / world,  # equal batches: the mean of the ranks' losses
                    "accuracy": sum(s[1] for s in stats) / (BATCH * world),
                    "lr": lr,
                    "grad_norm": norm,
                    "clipped_norm": after,
                    "host_reads": step_reads,
                }
            )
    return {
        "records": [
            {"step": r.step, "rank": r.rank, "sparse": r.sparse, "values": dict(r.values)} for r in sink.records
        ],
        "events": [e.to_dict() for e in sink.events],
        "refs": refs,
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {name: run(name, rank, world) for name in FRONT_ENDS}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
