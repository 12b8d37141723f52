"""A loop whose graph changes from one optimizer step to the next: every step is read from its own
graph. Autolog's per-``backward()`` path keeps state between calls (the run's fixed columns and
accuracy inputs, the last optimizer's parameter ids, the step's kind of micro-batches); a value
carried over from an earlier step's graph where the graph changed (an accumulation count, a toggled
``* 0.5``, a ``* 1``, undivided micro-batches) would store a number the loop's ``.item()`` does not
say."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.autolog._helpers import autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step

#: per optimizer step: (micro-batches, what each one's loss is multiplied by before backward(); None:
#: nothing, "half": x 0.5, "one": x 1, a number n: / n)
PLANS: list[tuple[int, object]] = [
    (4, 4),
    (2, 2),
    (1, "half"),
    (3, 3),
    (1, "one"),
    (2, None),  # undivided: the step's loss is the sum
    (1, None),
    (4, 4),
    (1, "half"),
    (2, 2),
    (2, "half"),  # the same weight on both: micro-batches of one loss, their mean
    (2, "one"),  # x 1 is no factor: undivided, the sum (a factor read at an earlier step would say "mean")
    (2, "half"),
]


def _given(loss: torch.Tensor, factor: object) -> torch.Tensor:
    if factor == "half":
        return loss * 0.5
    if factor == "one":
        return loss * 1
    if isinstance(factor, int):
        return loss / factor
    return loss


def test_each_step_is_read_from_its_own_graph_when_the_graph_changes_between_steps(sink: ListSink) -> None:
    torch.manual_seed(11)
    expected: list[tuple[float, float]] = []
    with autologged(sink, name="changing-graphs"):
        model = nn.Linear(6, 5)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for count, factor in PLANS:
            losses, correct, total = [], 0, 0
            for _ in range(count):
                x, y = torch.randn(8, 6), torch.randint(0, 5, (8,))
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                _given(loss, factor).backward()
                losses.append(loss.item())
                correct += int((logits.argmax(1) == y).sum().item())
                total += len(y)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            step_loss = sum(losses) if factor in (None, "one") else sum(losses) / len(losses)
            expected.append((step_loss, correct / total))
    records = assert_one_record_per_step(sink.records, len(PLANS))
    for record, (loss, accuracy), plan in zip(records, expected, PLANS):
        assert record.values["loss"] == pytest.approx(loss, rel=F32_REL), (record.step, plan)
        assert record.values["accuracy"] == pytest.approx(accuracy, rel=F32_REL), (record.step, plan)
