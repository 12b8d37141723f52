"""One rank of ``test_layers_fsdp2.py``: ``python -m tests.metrics.layers_fsdp2_worker OUT_DIR``.

An FSDP2 loop (every ``nn.Linear``, then the model, wrapped by ``fully_shard``: parameters and
gradients are ``DTensor`` shards, some uneven and one rank's shard of the last weight empty), each
rank its own batch, clipping before AdamW's step. The same loop runs per front-end:

* ``bare`` — no batchtap: its host reads per iteration are the baseline;
* ``tap`` — explicit ``bt.Tap`` with ``Layers`` and ``Histograms``;
* ``autolog`` — ``bt.autolog(layers=N)``, the model found from the optimizer's parameters.

References are taken in the same run with ``.full_tensor()`` (the whole parameter, gathered) and
``.item()``, outside the counted calls. Writes ``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from batchtap.metrics.histograms import histogram_edges
from batchtap.metrics.layers import layer_groups
from tests.conftest import ListSink

STEPS, EVERY, BINS, BATCH = 7, 3, 8, 8
FRONT_ENDS = ("bare", "tap", "autolog")


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    # Linear(32, 3): shards of 2 and 1 rows; Linear(3, 1): rank 1's shard of its weight is empty
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3), nn.Tanh(), nn.Linear(3, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _full(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    return [t.detach().full_tensor().double().reshape(-1).numpy() for t in tensors]  # a collective: every rank


def _norm(arrays: list[np.ndarray]) -> float:
    return math.sqrt(sum(float((a * a).sum()) for a in arrays))


def _histogram(arrays: list[np.ndarray]) -> list[float]:
    flat = np.concatenate(arrays).astype(np.float32).astype(np.float64)  # batchtap counts in float32
    counts, _ = np.histogram(flat, bins=histogram_edges(flat.min(), flat.max(), BINS))
    return [float(flat.min()), float(flat.max()), *counts.astype(float).tolist()]


def run(front_end: str, rank: int) -> dict:
    model = _model()
    groups = layer_groups(model)
    assert all(type(p).__name__ == "DTensor" for ps in groups.values() for p in ps)
    sink = ListSink()
    tap: bt.Tap | None = None
    context = contextlib.ExitStack()
    if front_end == "autolog":  # the optimizer made after autolog(): found when made, its first step captured
        bt.autolog(sinks=[sink], name=front_end, flush_every=5, layers=EVERY)
        context.callback(bt.autolog, enabled=False)
    elif front_end == "tap":
        metrics = [
            bt.metrics.Loss(),
            bt.metrics.Layers(model, every=EVERY),
            bt.metrics.Histograms(model, every=EVERY, bins=BINS),
        ]
        tap = bt.Tap(metrics, [sink], flush_every=5, collective_timeout=60.0)
        context.enter_context(tap)
        context.enter_context(tap.run(name=front_end))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    g = torch.Generator().manual_seed(100 + rank)
    refs = []
    with context:
        for step in range(STEPS):
            x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)
            with HostReadCounter() as reads:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
            host_reads = reads.count
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # the step uses clipped grads
            grads = {k: _full([p.grad for p in ps]) for k, ps in groups.items()}
            before = {k: _full(list(ps)) for k, ps in groups.items()}
            with HostReadCounter() as reads:
                opt.step()
                if tap is not None:
                    tap.step(loss=loss)
            host_reads += reads.count
            after = {k: _full(list(ps)) for k, ps in groups.items()}
            ref: dict[str, object] = {"host_reads": host_reads}
            if step % EVERY == 0:
                for k in groups:
                    ref[f"grad_norm/{k}"] = _norm(grads[k])
                    ref[f"weight_norm/{k}"] = _norm(after[k])
                    ref[f"update_ratio/{k}"] = _norm([a - b for a, b in zip(after[k], before[k])]) / _norm(before[k])
                    ref[f"hist/grad/{k}"] = _histogram(grads[k])
                    ref[f"hist/weight/{k}"] = _histogram(after[k])
            refs.append(ref)
    return {
        "records": [{"step": r.step, "sparse": r.sparse, "values": dict(r.values)} for r in sink.records],
        "events": [e.to_dict() for e in sink.events],
        "refs": refs,
    }


def _sharded_in_part() -> str:
    """What ``Histograms`` says of a model whose first layer only is sharded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    fully_shard(model[0])
    try:
        bt.metrics.Histograms(model, every=EVERY, bins=BINS)
    except bt.ConfigError as exc:
        return str(exc)
    return "no error"


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    result: dict[str, object] = {name: run(name, rank) for name in FRONT_ENDS}
    result["sharded_in_part"] = _sharded_in_part()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
