"""Row assembly (``autolog/_rows.py``) slips a sampled mutation run over issue 38's files let through
the other autolog tests (TESTING.md, "third session"); values against the loop's own ``.item()``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.autolog._helpers import autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step


def test_the_first_optimizers_uneven_accumulation_is_a_sample_weighted_mean(sink: ListSink) -> None:
    """Two optimizers; the first accumulates two micro-batches of 6 and 2 samples, each loss / 2, the
    second one backward per step: ``loss`` is the micro-batches' sample-weighted mean (not the sum
    of what backward() got, which is their plain mean), and accuracy counts both micro-batches."""
    torch.manual_seed(9)
    expected, hits = [], []
    with autologged(sink, name="first-accum"):
        a, b = nn.Linear(5, 3), nn.Linear(5, 3)
        opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.01), torch.optim.SGD(b.parameters(), lr=0.01)
        for _ in range(4):
            total, correct = 0.0, 0
            for n in (6, 2):
                x, y = torch.randn(n, 5), torch.randint(0, 3, (n,))
                logits = a(x)
                loss = F.cross_entropy(logits, y)
                (loss / 2).backward()
                total += loss.item() * n
                correct += int((logits.argmax(1) == y).sum())
            opt_a.step()
            opt_a.zero_grad()
            xb, yb = torch.randn(8, 5), torch.randint(0, 3, (8,))
            F.cross_entropy(b(xb), yb).backward()
            opt_b.step()
            opt_b.zero_grad()
            expected.append(total / 8)
            hits.append(correct / 8)
    for record, ref, acc in zip(assert_one_record_per_step(sink.records, 4), expected, hits):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step
        assert record.values["accuracy"] == pytest.approx(acc), record.step


@pytest.mark.parametrize("classify", [False, True], ids=["regression", "classification"])
def test_a_step_without_backward_after_steps_with_a_loss_is_said_and_not_recorded(
    sink: ListSink, classify: bool
) -> None:
    """An optimizer step with no ``backward()`` before it, in a run whose first step had a loss: the
    event names the missing loss (not the logits), and that step is not recorded."""
    torch.manual_seed(10)
    with autologged(sink, name="no-backward"):
        model = nn.Linear(4, 3 if classify else 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(4):
            x = torch.randn(8, 4)
            if step != 2:
                out = model(x)
                if classify:
                    loss = F.cross_entropy(out, torch.randint(0, 3, (8,)))
                else:
                    loss = F.mse_loss(out, torch.randn(8, 1))
                loss.backward()
            opt.step()
            opt.zero_grad()
    said = [e.message for e in sink.events if "came without the" in e.message]
    assert len(said) == 1 and "came without the loss that" in said[0], [e.message for e in sink.events]
    assert len([r for r in sink.records if not r.sparse and "loss" in r.values]) == 3


class _FlakyOnce(torch.optim.SGD):
    """An optimizer whose second step raises once (a loop that catches it and trains on)."""

    calls = 0

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        type(self).calls += 1
        if type(self).calls == 2:
            raise RuntimeError("flaky step")
        return super().step(closure)


def test_a_raised_step_after_micro_batches_were_handed_over_says_they_count_in_the_next_row(
    sink: ListSink,
) -> None:
    """One optimizer, two micro-batches (each loss / 2) per step; the second step raises and the loop
    goes on: the saying tells that the micro-batch already handed over counts in the next row."""
    torch.manual_seed(12)
    _FlakyOnce.calls = 0
    with autologged(sink, name="flaky"):
        model = nn.Linear(4, 3)
        opt = _FlakyOnce(model.parameters(), lr=0.01)
        for _ in range(3):
            for _ in range(2):
                loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
                (loss / 2).backward()
            try:
                opt.step()
            except RuntimeError:
                pass
            opt.zero_grad()
    said = [e.message for e in sink.events if "an optimizer step raised" in e.message]
    assert len(said) == 1 and "already handed over: they count in the next step's row" in said[0], said


def test_backward_of_a_graphless_placeholder_is_no_loss(sink: ListSink) -> None:
    """A step with no kept target computes a placeholder ``torch.zeros((), requires_grad=True)`` and
    calls ``backward()`` on it (a leaf: no graph, nothing of the model): that is not the step's
    loss; the step is said and left out, never stored as a loss of 0."""
    torch.manual_seed(13)
    expected = []
    with autologged(sink, name="placeholder"):
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(4):
            if step == 2:
                torch.zeros((), requires_grad=True).backward()
            else:
                loss = F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1))
                loss.backward()
                expected.append(loss.item())
            opt.step()
            opt.zero_grad()
    losses = [r.values["loss"] for r in sink.records if not r.sparse and "loss" in r.values]
    assert losses == pytest.approx(expected, rel=F32_REL)
