"""Loop shapes where a small slip in autolog gives a wrong number, each value against the loop's
own ``.item()`` (an independent mutation run planted exactly these slips and no test caught them):
a single divided loss, a summed loss with padding, a cast over a divided loss, weighted multi-task
losses, a second optimizer's accumulation, two optimizers under one GradScaler, one GradScaler per
model, and optimizers stepped with a closure (LBFGS)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from tests.autolog._helpers import autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step


def _norm(params: list[nn.Parameter]) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params if p.grad is not None))


def test_a_single_divided_loss_is_undone(sink: ListSink) -> None:
    """``(mse / 2).backward()`` once per step: the division is undone, the loss is the mse."""
    torch.manual_seed(0)
    expected = []
    with autologged(sink, name="half-mse"):
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            mse = F.mse_loss(model(x), y)
            (mse / 2).backward()
            opt.step()
            opt.zero_grad()
            expected.append(mse.item())
    for record, ref in zip(assert_one_record_per_step(sink.records, 4), expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step


def test_a_summed_loss_is_divided_by_its_kept_targets(sink: ListSink) -> None:
    """``F.cross_entropy(..., reduction="sum")`` with -100 padding: the per-target mean over the kept
    targets (not the sum, not the mean over every position)."""
    torch.manual_seed(1)
    expected = []
    with autologged(sink, name="summed"):
        model = nn.Linear(6, 5)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            x, y = torch.randn(12, 6), torch.randint(0, 5, (12,))
            y[:4] = -100
            total = F.cross_entropy(model(x), y, reduction="sum")
            total.backward()
            opt.step()
            opt.zero_grad()
            expected.append(total.item() / 8)
    for record, ref in zip(assert_one_record_per_step(sink.records, 4), expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step


def test_a_cast_over_a_divided_loss_is_walked_through(sink: ListSink) -> None:
    """``(loss / 16).float().backward()`` with a bfloat16 model: the cast changes nothing but the
    dtype; the division under it is undone and the loss found (with accuracy)."""
    torch.manual_seed(2)
    expected = []
    with autologged(sink, name="cast"):
        model = nn.Linear(6, 3).to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            x, y = torch.randn(8, 6, dtype=torch.bfloat16), torch.randint(0, 3, (8,))
            loss = F.cross_entropy(model(x), y)
            (loss / 16).float().backward()
            opt.step()
            opt.zero_grad()
            expected.append(loss.float().item())
    for record, ref in zip(assert_one_record_per_step(sink.records, 4), expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step
        assert "accuracy" in record.values


def test_weighted_multi_task_losses_are_their_weighted_sum(sink: ListSink) -> None:
    """Two heads, ``(0.3 * ce_a).backward(retain_graph=True); (0.7 * ce_b).backward()``: the same
    graph shape, each scaled by a constant, but different constants: two weighted losses, not two
    micro-batches of one accumulation. The loss is what the gradients minimise, 0.3 ce_a + 0.7 ce_b."""
    torch.manual_seed(3)
    expected = []
    with autologged(sink, name="multi-task"):
        trunk, head_a, head_b = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 4)
        opt = torch.optim.SGD([*trunk.parameters(), *head_a.parameters(), *head_b.parameters()], lr=0.01)
        for _ in range(4):
            x, ya, yb = torch.randn(8, 6), torch.randint(0, 3, (8,)), torch.randint(0, 4, (8,))
            h = trunk(x).relu()
            ce_a, ce_b = F.cross_entropy(head_a(h), ya), F.cross_entropy(head_b(h), yb)
            (0.3 * ce_a).backward(retain_graph=True)
            (0.7 * ce_b).backward()
            opt.step()
            opt.zero_grad()
            expected.append(0.3 * ce_a.item() + 0.7 * ce_b.item())
    for record, ref in zip(assert_one_record_per_step(sink.records, 4), expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step


def test_a_second_optimizers_accumulation_is_a_mean(sink: ListSink) -> None:
    """A GAN-like pair: optimizer 0 one backward per step, optimizer 1 two micro-batches each
    divided by 2: ``loss_1`` is their mean, not their sum."""
    torch.manual_seed(4)
    expected = []
    with autologged(sink, name="second-accum"):
        a, b = nn.Linear(5, 3), nn.Linear(5, 3)
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
        for _ in range(4):
            x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
            F.cross_entropy(a(x), y).backward()
            opt_a.step()
            opt_a.zero_grad()
            losses = []
            for _ in range(2):
                xb, yb = torch.randn(8, 5), torch.randint(0, 3, (8,))
                loss = F.cross_entropy(b(xb), yb)
                (loss / 2).backward()
                losses.append(loss.item())
            opt_b.step()
            opt_b.zero_grad()
            expected.append(sum(losses) / 2)
    for record, ref in zip(assert_one_record_per_step(sink.records, 4), expected):
        assert record.values["loss_1"] == pytest.approx(ref, rel=F32_REL), record.step


def test_two_optimizers_under_one_scaler_keep_a_skip(sink: ListSink) -> None:
    """One GradScaler over two optimizers; at step 2 only the second model's gradients are inf: the
    scaler skips that optimizer's step, and the row says the step was skipped."""
    torch.manual_seed(5)
    skipped_at = 2
    with autologged(sink, name="one-scaler"):
        a, b = nn.Linear(5, 3), nn.Linear(5, 3)
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(5):
            x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
            loss = F.cross_entropy(a(x), y) + F.cross_entropy(b(x), y) * (math.inf if step == skipped_at else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
            opt_a.zero_grad()
            opt_b.zero_grad()
    rows = assert_one_record_per_step(sink.records, 5)
    assert [r.values.get("amp_skipped") for r in rows] == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_one_scaler_per_model_stores_the_scale_each_step_used(sink: ListSink) -> None:
    """A GradScaler per model, each growing its scale at every update: ``loss_scale`` is the scale
    the first optimizer's loss was multiplied by at that step, not the one update() set after it."""
    torch.manual_seed(6)
    used = []
    with autologged(sink, name="two-scalers"):
        a, b = nn.Linear(5, 3), nn.Linear(5, 3)
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
        scaler_a = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=1)
        scaler_b = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
        for _ in range(4):
            x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
            used.append(scaler_a.get_scale())
            scaler_a.scale(F.cross_entropy(a(x), y)).backward()
            scaler_a.step(opt_a)
            scaler_a.update()
            scaler_b.scale(F.cross_entropy(b(x), y)).backward()
            scaler_b.step(opt_b)
            scaler_b.update()
            opt_a.zero_grad()
            opt_b.zero_grad()
    rows = assert_one_record_per_step(sink.records, 4)
    assert [r.values["loss_scale"] for r in rows] == used == [64.0, 128.0, 256.0, 512.0]


def test_closure_steps_are_recorded(sink: ListSink) -> None:
    """``optimizer.step(closure)`` (LBFGS; Lightning steps every optimizer this way): the closure
    runs forward and backward inside the step; every step is a row with the closure's loss."""
    torch.manual_seed(7)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses: list[float] = []
    with autologged(sink, name="lbfgs"):
        model = nn.Linear(4, 1)
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=1)
        for _ in range(5):

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                losses.append(loss.item())
                return loss

            opt.step(closure)
    rows = assert_one_record_per_step(sink.records, 5)
    assert len(losses) == 5  # max_iter=1: one evaluation per step
    for record, ref in zip(rows, losses):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step
        assert record.values["grad_norm"] > 0
    assert not [e for e in sink.events if e.kind == bt.EventKind.ANOMALY]
