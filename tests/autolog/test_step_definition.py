"""One definition of the step's values under ``bt.autolog()``, against the loop's own ``.item()``:

* the gradient norm is the one *before* clipping, whichever way the loop clips — ``clip_grad_norm_``,
  ``get_total_norm`` + ``clip_grads_with_norm_`` (Accelerate >= 1.x, so the HF Trainer), the real
  ``Accelerator.clip_grad_norm_`` — and each model's own when two models clip differently;
* the step's loss is the loss its gradients minimise: ``(loss * 1).backward()`` is
  ``loss.backward()``; token-normalised accumulation (``CE(reduction="sum") / num_items_in_batch``,
  a tensor) is ``sum(CE) / N`` over the step, read from the graph on the device.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from tests.autolog._helpers import Reads, autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step, events_of


def _norm(params: list[nn.Parameter]) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params if p.grad is not None))


def _warnings(sink: ListSink) -> list[str]:
    return [e.message for e in events_of(sink.events, bt.EventKind.WARNING)]


def _notes(sink: ListSink) -> list[str]:
    """The ``info`` events: how autolog read the loop (accumulation, several losses), each said once."""
    return [e.message for e in events_of(sink.events, bt.EventKind.INFO)]


def _clip_torch(params: list[nn.Parameter], max_norm: float) -> None:
    torch.nn.utils.clip_grad_norm_(params, max_norm)


def _clip_two_calls(params: list[nn.Parameter], max_norm: float) -> None:
    # how Accelerate >= 1.x clips (and so the HF Trainer): the norm first, then the clipping with it
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def _clip_accelerate(params: list[nn.Parameter], max_norm: float) -> None:
    from accelerate import Accelerator

    Accelerator(cpu=True).clip_grad_norm_(params, max_norm)


@pytest.mark.parametrize(
    "clip",
    [_clip_torch, _clip_two_calls, _clip_accelerate],
    ids=["clip_grad_norm_", "get_total_norm+clip_grads_with_norm_", "Accelerator.clip_grad_norm_"],
)
def test_the_norm_before_clipping_whichever_way_the_loop_clips(sink: ListSink, clip: object) -> None:
    if clip is _clip_accelerate:
        pytest.importorskip("accelerate")
    torch.manual_seed(0)
    truth, clipped = [], []
    reads = Reads()
    with autologged(sink, name="clip"):
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)  # (AdamW's CPU step reads its step count)
        for step in range(6):
            x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
            with reads.iteration(step):
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
            truth.append(_norm(params))
            clip(params, 0.1)  # type: ignore[operator]  # torch's own clipping reads the host on the CPU
            clipped.append(_norm(params))
            with reads.iteration(step):
                opt.step()
    rows = assert_one_record_per_step(sink.records, 6)
    for record, ref, after in zip(rows, truth, clipped):
        assert after == pytest.approx(0.1, rel=1e-3) and ref > 0.3  # it did clip
        assert record.values["grad_norm"] == pytest.approx(ref, rel=F32_REL), record.step
    assert sum(reads.counts) == 0, reads.counts  # autolog's hooks and patches added none


def test_each_model_takes_its_own_clip(sink: ListSink) -> None:
    """Two models, two optimizers; only B clips, and A steps first: A's norm is computed from A's
    gradients, B's is B's pre-clip norm — never A's taken from B's clip, nor B's clipped norm."""
    torch.manual_seed(1)
    refs = []
    with autologged(sink, name="two-models"):
        a, b = nn.Linear(5, 2), nn.Linear(5, 2)
        opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
        opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
        for _ in range(4):
            x, y = torch.randn(8, 5), torch.randint(0, 2, (8,))
            opt_a.zero_grad()
            opt_b.zero_grad()
            F.cross_entropy(a(x), y).backward()
            F.cross_entropy(b(x), y).backward()
            ref_a, ref_b = _norm(list(a.parameters())), _norm(list(b.parameters()))
            torch.nn.utils.clip_grad_norm_(b.parameters(), 0.01)
            opt_a.step()
            opt_b.step()
            refs.append((ref_a, ref_b))
    rows = assert_one_record_per_step(sink.records, 4)
    for record, (ref_a, ref_b) in zip(rows, refs):
        assert ref_b > 0.05
        assert record.values["grad_norm"] == pytest.approx(ref_a, rel=F32_REL), record.step
        assert record.values["grad_norm_1"] == pytest.approx(ref_b, rel=F32_REL), record.step


@pytest.mark.parametrize("times_one", [False, True], ids=["loss.backward()", "(loss * 1).backward()"])
def test_times_one_changes_nothing(sink: ListSink, times_one: bool) -> None:
    """Undivided accumulation: the gradients minimise the sum of the micro-batch losses, whether the
    loop multiplies by 1 first (the HF Trainer's ``loss *= num_processes`` on one process) or not;
    and no message claims a division that did not happen. Accuracy counts every micro-batch's targets."""
    torch.manual_seed(2)
    expected = []
    with autologged(sink, name="times-one"):
        model = nn.Linear(6, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(4):
            total, correct = 0.0, 0
            for _ in range(3):
                x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
                out = model(x)
                loss = F.cross_entropy(out, y)
                (loss * 1 if times_one else loss).backward()
                total += loss.item()
                correct += int((out.argmax(1) == y).sum().item())
            opt.step()
            opt.zero_grad()
            expected.append((total, correct / 24))
    rows = assert_one_record_per_step(sink.records, 4)
    for record, (ref, accuracy) in zip(rows, expected):
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step
        assert record.values["accuracy"] == pytest.approx(accuracy, abs=1e-9), record.step
    warnings = _notes(sink)  # how autolog read the loop: a note, not a warning
    assert not [m for m in warnings if "undone" in m or "gradient-accumulation" in m], warnings
    assert len([m for m in warnings if "several losses, loss = their sum" in m]) == 1, warnings


def _shifted_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # the HF causal-LM loss: predict token t+1 from t, -100 left out, summed
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def test_token_normalised_accumulation_is_sum_ce_over_n(sink: ListSink) -> None:
    """The HF Trainer's causal-LM path: each micro-batch backpropagates ``CE(sum) / N``, N the kept
    tokens of the whole optimizer step (a tensor): the step's loss is sum(CE) / N, not the mean of
    the micro-batches' token means (which differs when their kept tokens differ)."""
    torch.manual_seed(3)
    vocab, accum = 11, 3
    expected, means_of_means = [], []
    reads = Reads()
    with autologged(sink, name="token-normalised"):
        emb, head = nn.Embedding(vocab, 16), nn.Linear(16, vocab)
        with torch.no_grad():
            head.weight.mul_(4.0)  # confident logits: per-token losses far apart, so definitions differ
        opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1)
        for step in range(5):
            batches = []
            for k in range(accum):
                tokens = torch.randint(0, vocab, (4, 9))
                labels = tokens.clone()
                labels[:, 9 - 3 * k - 1 :] = -100  # padding: uneven kept tokens per micro-batch (28, 16, 4)
                batches.append((tokens, labels))
            n_items = sum((labels[:, 1:] != -100).sum() for _, labels in batches)  # a tensor, as HF's
            total, means = 0.0, []
            for tokens, labels in batches:
                with reads.iteration(step):
                    ce = _shifted_ce_sum(head(emb(tokens)), labels)
                    (ce / n_items).backward()
                total += ce.item()
                means.append(ce.item() / (labels[:, 1:] != -100).sum().item())
            with reads.iteration(step):
                opt.step()
                opt.zero_grad()
            expected.append(total / n_items.item())
            means_of_means.append(sum(means) / len(means))
    rows = assert_one_record_per_step(sink.records, 5)
    for record, ref, wrong in zip(rows, expected, means_of_means):
        assert abs(ref - wrong) > 1e-3 * ref  # the two definitions differ here: the test can tell
        assert record.values["loss"] == pytest.approx(ref, rel=F32_REL), record.step
    assert sum(reads.counts) == 0, reads.counts
    warnings = _notes(sink)  # how autolog read the loop: a note, not a warning
    assert any("token-normalised" in m for m in warnings), warnings
