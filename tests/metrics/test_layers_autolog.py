"""bt.autolog(layers=N): the model is found from the optimizer's parameters, and the per-layer
values equal the .item() computation on every N-th optimizer step, with no host read added."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from batchtap.metrics.layers import layer_groups
from tests.autolog._helpers import Reads, autologged
from tests.conftest import ListSink

ROOT = Path(__file__).resolve().parents[2]


def _norm(ts: list[torch.Tensor]) -> float:
    return math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in ts))


@pytest.mark.parametrize(
    ("ddp_style", "made_before"),
    [(False, False), (True, False), (False, True)],
    ids=["plain", "wrapped-in-.module", "optimizer-made-before-autolog"],
)
def test_autolog_layers_equal_item_every_nth_step(sink: ListSink, ddp_style: bool, made_before: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 4))
    wrapper = nn.Module()
    wrapper.module = model  # a DDP-style wrapper: its layers keep the model's own names
    # SGD: Adam reads its step count on the host by itself on the CPU (not batchtap's reads)
    make = lambda: torch.optim.SGD((wrapper if ddp_style else model).parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    opt = make() if made_before else None
    groups = layer_groups(model)
    g = torch.Generator().manual_seed(1)
    expected: dict[int, dict[str, float]] = {}
    reads = Reads()
    with autologged(sink, layers=3):
        if opt is None:
            opt = make()  # found when made: its first step is captured
        for step in range(9):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
            with reads.iteration(step):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            grads = {k: _norm([p.grad for p in ps]) for k, ps in groups.items()}
            before = {k: [p.detach().clone() for p in ps] for k, ps in groups.items()}
            with reads.iteration(step):
                opt.step()
            # an optimizer made before autolog() is found in its first step, too late to capture it
            if step % 3 == 0 and not (made_before and step == 0):
                expected[step] = {}
                for k, ps in groups.items():
                    expected[step][f"grad_norm/{k}"] = grads[k]
                    expected[step][f"weight_norm/{k}"] = _norm(list(ps))
                    moved = _norm([p.detach() - b for p, b in zip(ps, before[k])])
                    expected[step][f"update_ratio/{k}"] = moved / _norm(before[k])
    assert reads.counts and set(reads.counts) == {0}, reads.counts
    by_step = {r.step: r.values for r in sink.records}
    assert sorted(by_step) == list(range(9))
    for step, values in by_step.items():
        got = {k: v for k, v in values.items() if "/" in k}  # grad_norm alone is autolog's global norm
        if step not in expected:
            assert got == {}, step
            continue
        assert sorted(got) == sorted(expected[step])
        for name, value in expected[step].items():
            assert got[name] == pytest.approx(value, rel=1e-5), (step, name)


SCRIPT = """
import json, math, sys
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
norm = lambda ts: math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in ts))
hand = {}
for step in range(6):
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = {k: norm([p.grad for p in model[int(k)].parameters()]) for k in ("0", "2")}
    opt.step()
    if step % 2 == 0:
        hand[step] = {f"grad_norm/{k}": v for k, v in grads.items()}
        hand[step].update({f"weight_norm/{k}": norm(list(model[int(k)].parameters())) for k in ("0", "2")})
json.dump(hand, open(sys.argv[1], "w"))
"""


def test_batchtap_run_layers_stores_the_per_layer_values(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    db, out = tmp_path / "b.db", tmp_path / "hand.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "batchtap", "run", "--db", str(db), "--layers", "2", str(script), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    hand = {int(k): v for k, v in json.loads(out.read_text()).items()}
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT metric, step, value FROM metrics WHERE metric LIKE '%/%'").fetchall()
    stored: dict[int, dict[str, float]] = {}
    for metric, step, value in rows:
        stored.setdefault(step, {})[metric] = value
    assert sorted(stored) == [0, 2, 4]
    for step, values in hand.items():
        for name, value in values.items():
            assert stored[step][name] == pytest.approx(value, rel=1e-5), (step, name)
    bad = subprocess.run([*command[:6], "--layers", "0", str(script)], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--layers must be >= 1" in bad.stderr
