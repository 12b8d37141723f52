"""Autolog's optimizer steps and backward() calls in loops that are not the plain one (issue 26):
an optimizer step that raises (caught by the loop, then normal steps), several losses per step
(a DCGAN-style discriminator, a weighted auxiliary loss) told from gradient accumulation by the
graph alone, each value against the loop's own ``.item()``."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from tests.autolog._helpers import autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step, events_of


class RaisingSGD(torch.optim.SGD):
    """SGD whose step raises once when told (an optimizer bug, a NaN check), calling ``super().step()``
    otherwise (nested hooks when plain SGD's step is hooked too)."""

    fail_next = False

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("planted")
        return super().step(closure)


def _norm(model: nn.Module) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters() if p.grad is not None))


def _warnings(sink: ListSink) -> list[str]:
    return [e.message for e in events_of(sink.events, bt.EventKind.WARNING)]


def _notes(sink: ListSink) -> list[str]:
    """The ``info`` events: how autolog read the loop (accumulation, several losses), each said once."""
    return [e.message for e in events_of(sink.events, bt.EventKind.INFO)]


@pytest.mark.parametrize("after_raise", ["retry", "next-batch"])
def test_a_step_that_raises_does_not_stop_the_recording(sink: ListSink, after_raise: str) -> None:
    torch.manual_seed(0)
    expected = []
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)  # plain SGD's step hooked too: RaisingSGD's nest
    with autologged(sink, name="raises"):
        model = nn.Linear(6, 3)
        opt = RaisingSGD(model.parameters(), lr=0.1)
        for step in range(8):
            x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            norm = _norm(model)
            if step == 2:
                opt.fail_next = True
                with pytest.raises(RuntimeError, match="planted"):
                    opt.step()  # its post-hooks never fire
                if after_raise == "next-batch":
                    continue  # this batch is dropped: no step, no row
            opt.step()
            acc = (out.argmax(1) == y).sum().item() / len(y)
            expected.append({"loss": loss.item(), "accuracy": acc, "grad_norm": norm})
    rows = assert_one_record_per_step(sink.records, len(expected))
    assert len(rows) == (8 if after_raise == "retry" else 7)
    for record, ref in zip(rows, expected):
        assert record.values["loss"] == ref["loss"], record.step
        assert record.values["accuracy"] == ref["accuracy"], record.step
        assert record.values["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), record.step
    warnings = _warnings(sink)
    if after_raise == "next-batch":
        assert len(warnings) == 1 and "raised" in warnings[0], warnings
    else:
        assert not warnings, warnings


def test_dcgan_discriminator_losses_are_summed(sink: ListSink) -> None:
    """PyTorch's DCGAN example: ``errD_real.backward(); errD_fake.backward(); optimizerD.step()``,
    and it prints ``errD = errD_real + errD_fake``."""
    torch.manual_seed(0)
    expected = []
    with autologged(sink, name="dcgan"):
        G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        opt_d = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
        opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
        criterion = nn.BCEWithLogitsLoss()
        for _ in range(10):
            real = torch.randn(16, 8) + 2.0
            D.zero_grad()
            label = torch.full((16,), 1.0)
            err_real = criterion(D(real).view(-1), label)
            err_real.backward()
            fake = G(torch.randn(16, 4))
            label.fill_(0.0)
            err_fake = criterion(D(fake.detach()).view(-1), label)
            err_fake.backward()
            err_d = err_real + err_fake
            opt_d.step()
            G.zero_grad()
            label.fill_(1.0)
            err_g = criterion(D(fake).view(-1), label)
            err_g.backward()
            opt_g.step()
            expected.append({"loss": err_d.item(), "loss_1": err_g.item()})
    rows = assert_one_record_per_step(sink.records, 10)
    for record, ref in zip(rows, expected):
        assert record.values["loss"] == pytest.approx(ref["loss"], rel=F32_REL), record.step
        assert record.values["loss_1"] == ref["loss_1"], record.step
    warnings = _notes(sink)  # how autolog read the loop: a note, not a warning
    assert any("several losses, loss = their sum" in m for m in warnings), warnings
    assert not any("accumulation micro-batches" in m for m in warnings), warnings


def test_weighted_auxiliary_loss_is_the_weighted_sum_said_once(sink: ListSink) -> None:
    """``ce.backward(retain_graph=True); (0.1 * aux).backward()``: one divided, one not, so the graph
    does not say accumulation: the sum of the tensors given to backward() (weights kept), said once;
    accuracy from the classification loss."""
    torch.manual_seed(0)
    expected = []
    with autologged(sink, name="aux"):
        model = nn.Linear(6, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(6):
            x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
            opt.zero_grad()
            out = model(x)
            ce = F.cross_entropy(out, y)
            aux = out.pow(2).mean()
            ce.backward(retain_graph=True)
            (0.1 * aux).backward()
            opt.step()
            acc = (out.argmax(1) == y).sum().item() / len(y)
            expected.append({"loss": ce.item() + 0.1 * aux.item(), "accuracy": acc})
    rows = assert_one_record_per_step(sink.records, 6)
    for record, ref in zip(rows, expected):
        assert record.values["loss"] == pytest.approx(ref["loss"], rel=F32_REL), record.step
        assert record.values["accuracy"] == ref["accuracy"], record.step
    warnings = _notes(sink)  # how autolog read the loop: a note, not a warning
    assert len([m for m in warnings if "assumed to be several losses" in m]) == 1, warnings


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "GradScaler"])
def test_accumulation_divided_by_its_count_is_a_mean(sink: ListSink, scaled: bool) -> None:
    """``(loss / accum).backward()`` per micro-batch, the same graph each time: accumulation, the
    sample-weighted mean of the micro-batch losses (with a GradScaler's scale undone, not taken for
    an accumulation count)."""
    torch.manual_seed(0)
    accum, sizes = 3, (8, 8, 4)
    expected = []
    with autologged(sink, name="accum"):
        model = nn.Linear(6, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=scaled)
        for _ in range(5):
            losses = []
            for n in sizes:
                x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
                loss = F.cross_entropy(model(x), y)
                scaler.scale(loss / accum).backward()
                losses.append((loss.item(), n))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            expected.append(sum(v * n for v, n in losses) / sum(sizes))
    rows = assert_one_record_per_step(sink.records, 5)
    for record, ref in zip(rows, expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step
    warnings = _notes(sink)  # how autolog read the loop: a note, not a warning
    assert any("gradient-accumulation micro-batches" in m for m in warnings), warnings
    assert not any("several losses" in m for m in warnings), warnings


def test_accumulation_without_division_is_the_sum_said_once(sink: ListSink) -> None:
    """Micro-batches whose losses are not divided: the gradients are those of the sum, and the graph
    cannot tell them from several losses: their sum, and one warning saying what was assumed."""
    torch.manual_seed(0)
    expected = []
    with autologged(sink, name="undivided"):
        model = nn.Linear(6, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            total = 0.0
            for _ in range(2):
                x, y = torch.randn(8, 6), torch.randn(8, 1)
                loss = F.mse_loss(model(x), y)
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            expected.append(total)
    rows = assert_one_record_per_step(sink.records, 4)
    for record, ref in zip(rows, expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step
    warnings = _notes(sink)  # how autolog read the loop: a note, not a warning
    assert len([m for m in warnings if "several losses, loss = their sum" in m]) == 1, warnings
