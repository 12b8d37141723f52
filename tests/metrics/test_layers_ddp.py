"""Layers under DDP on 2 real gloo ranks: the per-layer gradient norm is of the all-reduced (global)
gradients, equal to the ``.item()`` computation on each rank, and the reduced records carry it.

Run by the test as ``python -m tests.metrics.test_layers_ddp OUT_DIR`` (one process per rank,
MASTER_ADDR/PORT, RANK, WORLD_SIZE in the environment, as torchrun sets them).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 6, 2


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    import batchtap as bt
    from batchtap.metrics.layers import layer_groups

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on both ranks, as DDP requires
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    groups = layer_groups(model)
    layers = bt.metrics.Layers(model, every=EVERY)
    tap = bt.Tap([bt.metrics.Loss(), layers], [bt.sinks.JSONL(out / f"metrics{rank}.jsonl")], flush_every=2)
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batches: local gradients differ
    hand: dict[int, dict[str, float]] = {}
    local: dict[int, dict[str, float]] = {}

    def norm(ts: list[torch.Tensor]) -> float:
        return math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in ts))

    with tap, tap.run(name="ddp"):
        for step in range(STEPS):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            before = {k: [p.detach().clone() for p in ps] for k, ps in groups.items()}
            grads = {k: norm([p.grad for p in ps]) for k, ps in groups.items()}
            # a rank's own gradient, for the check that the recorded one is the global one
            local[step] = {
                k: norm([torch.autograd.grad(F.cross_entropy(model(x), y), ps)[0]]) for k, ps in groups.items()
            }
            opt.step()
            if step % EVERY == 0:
                hand[step] = {}
                for k, ps in groups.items():
                    hand[step][f"grad_norm/{k}"] = grads[k]
                    hand[step][f"weight_norm/{k}"] = norm(list(ps))
                    moved = norm([p.detach() - b for p, b in zip(ps, before[k])])
                    hand[step][f"update_ratio/{k}"] = moved / norm(before[k])
            tap.step(loss=loss)
    (out / f"rank{rank}.json").write_text(json.dumps({"hand": hand, "local": local}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_gloo_ranks_record_the_global_per_layer_values(tmp_path: Path) -> None:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE="2",
            PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.metrics.test_layers_ddp", str(tmp_path)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # DDP all-reduced the gradients: both ranks' hand values agree, and differ from a rank's own
    for step, values in results[0]["hand"].items():
        for name, value in values.items():
            assert results[1]["hand"][step][name] == pytest.approx(value, rel=1e-6)
        local = results[0]["local"][step]["0"]
        assert abs(local - values["grad_norm/0"]) > 1e-4 * values["grad_norm/0"]
    records = [
        json.loads(line)
        for r in range(2)
        if (tmp_path / f"metrics{r}.jsonl").exists()
        for line in (tmp_path / f"metrics{r}.jsonl").read_text().splitlines()
    ]
    records = [r for r in records if r.get("type") == "record"]
    assert records, logs
    hand = {int(k): v for k, v in results[0]["hand"].items()}
    seen = set()
    for record in records:
        step = record["step"]
        got = {k: record[k] for k in record if k.split("/")[0] in ("grad_norm", "weight_norm", "update_ratio")}
        if step not in hand:
            assert got == {}, (step, got)
            continue
        seen.add(step)
        assert sorted(got) == sorted(hand[step])
        for name, value in hand[step].items():
            assert got[name] == pytest.approx(value, rel=1e-5), (step, name)
    assert seen == set(hand)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
