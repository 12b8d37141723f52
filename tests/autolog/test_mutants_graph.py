"""Loss shapes where a one-line slip in autolog's graph walk (``_graph.py``) or its loss-call
registry (``_losses.py``) changes a stored number; each found by a sampled mutation run over issue
38's files (TESTING.md, "third session") that the other autolog tests let through. Values are
checked against the loop's own ``.item()``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from batchtap.autolog._losses import _KEPT, LossCalls
from tests.autolog._helpers import autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step


def test_the_loss_call_registry_keeps_exactly_the_newest_calls() -> None:
    """A loop that computes losses it never trains on (validation, monitoring) leaves the registry
    at its bound: the newest ``_KEPT`` calls, oldest dropped first, never one fewer or unbounded."""
    calls = LossCalls()
    cross_entropy = calls._wrap(F.cross_entropy)
    logits = torch.randn(4, 3, requires_grad=True)
    outs = [cross_entropy(logits * (i + 1), torch.tensor([0, 1, 2, 0])) for i in range(_KEPT + 5)]
    assert len(calls.by_node) == _KEPT
    assert list(calls.by_node) == [out.grad_fn for out in outs[-_KEPT:]]


def test_a_summed_loss_times_a_constant_is_its_per_target_mean(sink: ListSink) -> None:
    """``(0.5 * CE(reduction="sum")).backward()`` with padding: a weight, not a token count the loop
    divided by; the loss is the per-kept-target mean with the weight undone, as for any summed loss."""
    torch.manual_seed(6)
    expected = []
    with autologged(sink, name="weighted-sum"):
        model = nn.Linear(6, 5)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            x, y = torch.randn(12, 6), torch.randint(0, 5, (12,))
            y[:3] = -100
            total = F.cross_entropy(model(x), y, reduction="sum")
            (0.5 * total).backward()
            opt.step()
            opt.zero_grad()
            expected.append(total.item() / 9)
    for record, ref in zip(assert_one_record_per_step(sink.records, 4), expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step


def test_token_normalised_accumulation_is_the_summed_loss_over_the_steps_count(sink: ListSink) -> None:
    """Two micro-batches of ``CE(reduction="sum") / N``, N the step's kept targets (Hugging Face's
    ``num_items_in_batch``), with uneven padding: the loss is sum(CE) / N over the step."""
    torch.manual_seed(7)
    expected = []
    with autologged(sink, name="token-normalised"):
        model = nn.Linear(6, 5)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            xs = [torch.randn(10, 6), torch.randn(10, 6)]
            ys = [torch.randint(0, 5, (10,)), torch.randint(0, 5, (10,))]
            ys[0][:1] = -100
            ys[1][:6] = -100
            n = sum(int((y != -100).sum()) for y in ys)
            total = 0.0
            for x, y in zip(xs, ys):
                s = F.cross_entropy(model(x), y, reduction="sum")
                (s / n).backward()
                total += s.item()
            opt.step()
            opt.zero_grad()
            expected.append(total / n)
    for record, ref in zip(assert_one_record_per_step(sink.records, 4), expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step


def test_a_step_whose_every_target_is_padding_divided_by_its_zero_count_keeps_autolog_recording(
    sink: ListSink,
) -> None:
    """``CE(reduction="sum") / num_items`` with ``num_items == 0`` (a step of padding only, as Hugging
    Face computes it): the factor 0 has no inverse; autolog records the step and goes on, it does
    not stop on an error of its own (a ZeroDivisionError in the walk)."""
    torch.manual_seed(8)
    with autologged(sink, name="all-padding"):
        model = nn.Linear(6, 5)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(3):
            x, y = torch.randn(10, 6), torch.randint(0, 5, (10,))
            if step == 1:
                y[:] = -100
            n = int((y != -100).sum())
            (F.cross_entropy(model(x), y, reduction="sum") / n).backward()
            opt.step()
            opt.zero_grad()
    assert not [e for e in sink.events if "error of its own" in e.message], [e.message for e in sink.events]
    assert len([r for r in sink.records if not r.sparse]) == 3
