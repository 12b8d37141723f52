"""``bt.autolog()`` over an unmodified Hugging Face ``Trainer`` script: where the Trainer's own logged
loss is not the stored step loss (a BERT-like model whose loss the Trainer divides by the number of
micro-batches, a step of unequal micro-batches: a mean of means), the stored value is the mean over
the step's samples and autolog says why once, as an ``info`` note; a causal LM (token-normalised,
the Trainer's log agrees) and a hand-written loop with the same uneven step get no such note."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from tests.autolog._helpers import autologged
from tests.conftest import ListSink

tf = pytest.importorskip("transformers")
from tests.integrations.test_transformers import _args, _bert, _Data, _gpt2, _logged, _Seen  # noqa: E402

NOTE = "mean of means"


def _train(tmp_path: Any, model: Any, *, divide: bool) -> tuple[list[Any], ListSink, _Seen, Any]:
    sink = ListSink()
    seen = _Seen(model)
    # 22 rows in micro-batches of 4, 2 per step: steps of 4+4, 4+4, 4+2 samples each epoch
    with autologged(sink):
        trainer = tf.Trainer(model=model, args=_args(tmp_path), train_dataset=_Data(22, lm=not divide))
        if divide:  # BERT ignores num_items_in_batch: the Trainer divides each micro-batch mean by the count
            trainer.model_accepts_loss_kwargs = False
        trainer.train()
    return [r for r in sink.records if not r.sparse], sink, seen, trainer


def test_bert_under_accumulation_stores_the_samples_mean_and_says_once_why_the_trainer_differs(tmp_path) -> None:
    records, sink, seen, trainer = _train(tmp_path, _bert(), divide=True)
    notes = [e for e in sink.events if NOTE in e.message]
    assert len(notes) == 1 and notes[0].kind is bt.EventKind.INFO and "4, 2 samples" in notes[0].message
    micro = iter(seen.micro)
    uneven = 0
    for record, logged in zip(records, _logged(trainer, "loss"), strict=True):
        step = [next(micro) for _ in range(2)]
        sums = [F.cross_entropy(lg, lb, reduction="sum").item() for lg, lb in step]
        samples = [len(lb) for _, lb in step]
        assert record.values["loss"] == pytest.approx(sum(sums) / sum(samples), rel=1e-5)
        if len(set(samples)) > 1:
            uneven += 1
            assert logged != pytest.approx(record.values["loss"], rel=1e-5)  # the Trainer's mean of means
    assert uneven == 2


def test_a_causal_lm_whose_trainer_log_agrees_gets_no_note(tmp_path) -> None:
    records, sink, _, trainer = _train(tmp_path, _gpt2(), divide=False)
    assert not [e for e in sink.events if NOTE in e.message]
    assert [r.values["loss"] for r in records] == pytest.approx(_logged(trainer, "loss"), rel=1e-5)


def test_a_hand_written_loop_with_the_same_uneven_step_gets_no_note() -> None:
    sink = ListSink()
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with autologged(sink):
        for sizes in ((4, 4), (4, 2)):
            for n in sizes:
                x, y = torch.randn(n, 8), torch.randint(0, 3, (n,))
                (F.cross_entropy(net(x), y) / len(sizes)).backward()
            opt.step()
            opt.zero_grad()
    assert len([r for r in sink.records if not r.sparse]) == 2
    assert not [e for e in sink.events if NOTE in e.message]
