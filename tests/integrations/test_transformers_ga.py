"""Issue 29 item 2: a BERT-like model under gradient accumulation (forward takes ``**kwargs``, its
loss ignores ``num_items_in_batch``) makes the Trainer's step loss the *sum* of the micro-batch
means; batchtap says so once per run (a warning event and a log line) naming the fix. A real
Hugging Face Trainer with a tiny BERT from a config, on the CPU."""

from __future__ import annotations

import logging

import pytest
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink

tf = pytest.importorskip("transformers")
from batchtap.integrations.transformers import BatchtapTrainer, loss_sum_quirk  # noqa: E402
from tests.integrations.test_transformers import _args, _bert, _Data, _gpt2, _Seen, _steps  # noqa: E402


def _train(tmp_path, model, accum: int, *, fix: bool = False):  # type: ignore[no-untyped-def]
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=4)
    seen = _Seen(model)
    data = _Data(18, lm=not isinstance(model, tf.BertForSequenceClassification))
    trainer = BatchtapTrainer(
        model=model,
        args=_args(tmp_path, gradient_accumulation_steps=accum, num_train_epochs=1),
        train_dataset=data,
        tap=tap,
    )
    if fix:
        trainer.model_accepts_loss_kwargs = False
    trainer.train()
    tap.close()
    return sink, seen, trainer


def test_the_sum_of_means_is_warned_once_with_the_fix(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="batchtap"):
        sink, seen, trainer = _train(tmp_path, _bert(), accum=2)
    warnings = [e for e in sink.events if e.kind is bt.EventKind.WARNING and "model_accepts_loss_kwargs" in e.message]
    assert len(warnings) == 1 and "2x the step's mean loss" in warnings[0].message
    assert "BertForSequenceClassification" in warnings[0].message
    assert sum("model_accepts_loss_kwargs = False" in r.getMessage() for r in caplog.records) == 1
    # what the warning says: the stored (the Trainer's) loss is the sum of the micro-batch means
    steps = [r for r in sink.records if not r.sparse]
    for record, micro in zip(steps, _steps(seen.micro, per_epoch=5, accum=2), strict=True):
        means = [F.cross_entropy(lg, lb).item() for lg, lb in micro]
        assert record.values["loss"] == pytest.approx(sum(means), rel=1e-5)
    assert trainer.model_accepts_loss_kwargs


@pytest.mark.parametrize(
    ("model", "accum", "fix"),
    [
        pytest.param(_bert, 2, True, id="bert-with-the-documented-fix"),
        pytest.param(_bert, 1, False, id="bert-without-accumulation"),
        pytest.param(_gpt2, 2, False, id="gpt2-uses-the-count"),
    ],
)
def test_no_warning_where_the_loss_is_the_mean(tmp_path, model, accum: int, fix: bool) -> None:
    sink, _, _ = _train(tmp_path, model(), accum, fix=fix)
    assert not [e for e in sink.events if "model_accepts_loss_kwargs" in e.message]


def test_the_check_reads_settings_and_source_only(tmp_path) -> None:
    model = _bert()
    trainer = tf.Trainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=4))
    assert "4x" in (loss_sum_quirk(trainer, model) or "")
    model.accepts_loss_kwargs = False  # the model's own declaration settles it
    assert loss_sum_quirk(trainer, model) is None
