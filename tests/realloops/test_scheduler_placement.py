"""The explicit API's learning rate wherever ``scheduler.step()`` and ``tap.step()`` sit (issue 26).

The common PyTorch ordering, ``optimizer.step(); scheduler.step(); ...; tap.step(...)``, used to
record the *next* step's lr on every step (a warm-up + cosine schedule off by one for 30 of 30
steps). ``LearningRate`` now takes the lr in the optimizer's step pre-hook: every placement below
stores the lr each step used, compared with ``param_groups`` read right before ``optimizer.step()``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink
from tests.realloops._loops import assert_clean, assert_one_record_per_step

STEPS = 30


def warmup_cosine(step: int) -> float:
    return (step + 1) / 5 if step < 5 else 0.5 * (1 + math.cos(math.pi * (step - 5) / (STEPS - 5)))


@pytest.mark.parametrize(
    ("order", "pipeline"),
    [
        ("opt-sched-tap", "thread"),
        ("opt-tap-sched", "thread"),
        ("tap-opt-sched", "thread"),
        ("sched-opt-tap", "thread"),
    ],
)
def test_lr_is_the_one_the_step_used(sink: ListSink, order: str, pipeline: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    g = torch.Generator().manual_seed(1)
    tap = bt.Tap(optimizer=opt, sinks=[sink], flush_every=7, pipeline=pipeline)  # type: ignore[arg-type]
    used = []
    with tap, tap.run(name=order):
        for _ in range(STEPS):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            steps = {
                "opt-sched-tap": ("opt", "sched", "tap"),
                "opt-tap-sched": ("opt", "tap", "sched"),
                "tap-opt-sched": ("tap", "opt", "sched"),
                "sched-opt-tap": ("sched", "opt", "tap"),
            }[order]
            for what in steps:
                if what == "opt":
                    used.append(opt.param_groups[0]["lr"])
                    opt.step()
                elif what == "sched":
                    sched.step()
                elif what == "tap":
                    tap.step(loss=loss, outputs=out, targets=y)
    rows = assert_one_record_per_step(sink.records, STEPS)
    assert_clean(sink.events)
    assert len(set(used)) > 20  # the schedule moved at nearly every step
    assert [r.values["lr"] for r in rows] == used


def test_learning_rate_pickles_without_its_hook() -> None:
    """pipeline="process" finalizes metrics in another process: the hook stays with the optimizer."""
    import pickle

    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.3)
    metric = pickle.loads(pickle.dumps(bt.metrics.LearningRate(opt)))
    assert metric.finalize([0.3], None) == [0.3]
