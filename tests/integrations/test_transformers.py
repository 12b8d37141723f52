"""BatchtapTrainer driving a real Hugging Face Trainer on the CPU: tiny BERT and GPT-2 from configs.

Every stored value is compared with the Trainer's own logged values (``logging_steps=1``) and with a
reference computed by hand from the logits and labels each micro-batch produced (read with .item()
in the test's own forward hook, never by batchtap).
"""

from __future__ import annotations

import math
import os
import sqlite3
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from batchtap.records import RunStatus
from tests.conftest import ListSink
from tests.integrations._readme import readme_snippet

tf = pytest.importorskip("transformers")
from batchtap.integrations.transformers import NAN_FILTER_ADVICE, BatchtapTrainer  # noqa: E402

VOCAB = 64


class _Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token ids; LM labels with -100 padding at the end of each row, or class labels."""

    def __init__(self, n: int, lm: bool, seq: int = 12) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)
        self.pad = torch.randint(0, 5, (n,), generator=g)  # padded positions at the end of each row
        self.classes = torch.randint(0, 3, (n,), generator=g)
        self.lm = lm

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not self.lm:
            return {"input_ids": self.ids[i], "labels": self.classes[i]}
        labels = self.ids[i].clone()
        if self.pad[i]:
            labels[-int(self.pad[i]) :] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def _bert() -> Any:
    config = tf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
        max_position_embeddings=32,
    )
    return tf.BertForSequenceClassification(config)


def _gpt2() -> Any:
    config = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    model = tf.GPT2LMHeadModel(config)
    # The class name does not say "ForCausalLM", so without this the Trainer counts unshifted labels
    # for num_items_in_batch and its loss is low by the rows' first labels (docs/integrations.md).
    model.loss_type = "ForCausalLM"
    return model


def _args(tmp_path: Any, **overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_nan_inf_filter=False,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        max_grad_norm=0.5,
        seed=3,
    )
    settings.update(overrides)
    return tf.TrainingArguments(**settings)


class _Seen:
    """The test's own record of each training micro-batch (logits and labels), from a forward hook."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.micro: list[tuple[torch.Tensor, torch.Tensor]] = []
        model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if module.training:
            self.micro.append((output.logits.detach().clone(), kwargs["labels"].clone()))


def _steps(micro: list[Any], per_epoch: int, accum: int) -> list[list[Any]]:
    """Group micro-batches into optimizer steps as the Trainer does (a shorter last step per epoch)."""
    steps: list[list[Any]] = []
    for start in range(0, len(micro), per_epoch):
        epoch = micro[start : start + per_epoch]
        steps += [epoch[i : i + accum] for i in range(0, len(epoch), accum)]
    return steps


def _logged(trainer: Any, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def test_gpt2_with_accumulation_and_padding_records_the_trainers_loss_token_accuracy_lr_and_grad_norm(tmp_path) -> None:
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=4)
    model = _gpt2()
    seen = _Seen(model)
    trainer = BatchtapTrainer(model=model, args=_args(tmp_path), train_dataset=_Data(20, lm=True), tap=tap)
    trainer.train()
    tap.close()
    steps = [r for r in sink.records if not r.sparse]
    grouped = _steps(seen.micro, per_epoch=5, accum=2)  # 20 rows / 4 = 5 micro-batches: steps of 2, 2, 1
    assert [len(g) for g in grouped] == [2, 2, 1, 2, 2, 1]
    assert [r.step for r in steps] == list(range(trainer.state.global_step)) == list(range(6))
    assert [r.epoch for r in steps] == [0, 0, 0, 1, 1, 1]
    logged_loss, logged_norm, logged_lr = (_logged(trainer, k) for k in ("loss", "grad_norm", "learning_rate"))
    for record, micro, loss, norm, lr in zip(steps, grouped, logged_loss, logged_norm, logged_lr, strict=True):
        # by hand: token-mean cross-entropy over every kept (shifted) label of the step's micro-batches
        logits = [lg[:, :-1].reshape(-1, VOCAB) for lg, _ in micro]
        labels = [lb[:, 1:].reshape(-1) for _, lb in micro]
        total = sum(
            F.cross_entropy(lg, lb, ignore_index=-100, reduction="sum").item() for lg, lb in zip(logits, labels)
        )
        kept = sum((lb != -100).sum().item() for lb in labels)
        correct = sum(((lg.argmax(-1) == lb) & (lb != -100)).sum().item() for lg, lb in zip(logits, labels))
        assert record.values["loss"] == pytest.approx(total / kept, rel=1e-5)
        assert record.values["loss"] == pytest.approx(loss, rel=1e-5)  # the Trainer's own logged loss
        assert record.values["accuracy"] == pytest.approx(correct / kept, abs=1e-7)
        assert record.values["grad_norm"] == pytest.approx(norm, rel=1e-6)  # before clipping (max_grad_norm=0.5)
        assert record.values["lr"] == lr
    # timed from the previous step (the first step has no start); tokens/s of input_ids
    assert all(r.values["throughput"] > 0 and r.values["step_time"] > 0 for r in steps[1:])
    assert steps[1].values["throughput"] == pytest.approx(2 * 4 * 12 / steps[1].values["step_time"], rel=1e-3)
    assert any(v > 0.5 for v in logged_norm)  # clipping was active, so the pre-clip norm is what was compared
    (run,) = sink.ended
    assert run.status is RunStatus.FINISHED and run.config["gradient_accumulation_steps"] == 2


@pytest.mark.parametrize("accum", [pytest.param(1, id="no-accumulation"), pytest.param(2, id="accumulate-2")])
def test_bert_sequence_classification_records_per_example_accuracy_and_the_trainers_loss(tmp_path, accum) -> None:
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=4)
    model = _bert()
    seen = _Seen(model)
    trainer = BatchtapTrainer(
        model=model, args=_args(tmp_path, gradient_accumulation_steps=accum), train_dataset=_Data(18, lm=False), tap=tap
    )
    # BERT's forward takes **kwargs but ignores num_items_in_batch: the Trainer would then add up the
    # micro-batch means. Its documented switch makes it average them, as the docs tell users.
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    tap.close()
    steps = [r for r in sink.records if not r.sparse]
    grouped = _steps(seen.micro, per_epoch=5, accum=accum)  # 18 rows / 4: micro-batches of 4, 4, 4, 4, 2
    assert len(steps) == len(grouped) == trainer.state.global_step
    for record, micro, loss in zip(steps, grouped, _logged(trainer, "loss"), strict=True):
        means = [F.cross_entropy(lg, lb).item() for lg, lb in micro]
        correct = sum((lg.argmax(-1) == lb).sum().item() for lg, lb in micro)
        assert record.values["loss"] == pytest.approx(sum(means) / len(means), rel=1e-5)
        assert record.values["loss"] == pytest.approx(loss, rel=1e-5)
        assert record.values["accuracy"] == pytest.approx(correct / sum(len(lb) for _, lb in micro), abs=1e-7)


def test_evaluation_metrics_are_stored_as_sparse_values(tmp_path) -> None:
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=4)
    args = _args(tmp_path, eval_strategy="epoch", per_device_eval_batch_size=4)
    trainer = BatchtapTrainer(
        model=_bert(), args=args, train_dataset=_Data(16, lm=False), eval_dataset=_Data(8, lm=False), tap=tap
    )
    trainer.train()
    tap.close()
    evals = [r for r in sink.records if r.sparse]
    assert len(evals) == 2 and all("eval_loss" in r.values for r in evals)
    assert [r.values["eval_loss"] for r in evals] == pytest.approx(_logged(trainer, "eval_loss"), rel=1e-6)
    assert [r.step for r in evals] == [1, 3]  # after the last step of each epoch (2 steps per epoch)


class _Boom(tf.TrainerCallback):  # type: ignore[misc]
    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == 3:
            raise RuntimeError("boom")


def test_a_raise_inside_training_stores_the_run_as_failed_with_every_captured_step(tmp_path) -> None:
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=50)  # nothing flushed before the failure
    trainer = BatchtapTrainer(
        model=_gpt2(), args=_args(tmp_path), train_dataset=_Data(20, lm=True), tap=tap, callbacks=[_Boom()]
    )
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    tap.close()
    assert [r.step for r in sink.records] == [0, 1, 2]
    (run,) = sink.ended
    assert run.status is RunStatus.FAILED and run.stop_reason == "RuntimeError: boom"


class _NanAt(torch.nn.Module):
    """GPT-2 whose loss turns NaN at one training forward (a loss spike gone bad)."""

    def __init__(self, model: Any, at: int) -> None:
        super().__init__()
        self.model, self.at, self.calls = model, at, 0
        self.config, self.loss_type = model.config, model.loss_type

    def forward(self, **kwargs: Any) -> Any:
        out = self.model(**kwargs)
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                out.loss = out.loss * math.nan
        return out


def test_a_nan_loss_stops_the_trainer_and_the_run_is_stored_as_stopped(tmp_path) -> None:
    sink = ListSink()
    tap = bt.Tap(sinks=[sink], flush_every=50)
    model = _NanAt(_gpt2(), at=5)  # the first micro-batch of step 2
    trainer = BatchtapTrainer(
        model=model,
        args=_args(tmp_path, num_train_epochs=5, remove_unused_columns=False),
        train_dataset=_Data(20, lm=True),
        tap=tap,
    )
    trainer.train()
    tap.close()
    assert trainer.state.global_step == 3  # stopped at the step whose loss was NaN (on the CPU: that step)
    assert math.isnan(sink.records[2].values["loss"])
    assert sink.ended[0].status is RunStatus.STOPPED and "loss" in sink.ended[0].stop_reason


def _reads(tmp_path: Any, trainer_class: Any, epochs: int, **kwargs: Any) -> Counter[str]:
    torch.manual_seed(0)
    args = _args(tmp_path, logging_steps=1000, num_train_epochs=epochs)
    trainer = trainer_class(model=_gpt2(), args=args, train_dataset=_Data(20, lm=True), **kwargs)
    with HostReadCounter() as reads:
        trainer.train()
    return Counter(r.op for r in reads.reads)


@pytest.mark.parametrize("epochs", [pytest.param(1, id="3-steps"), pytest.param(2, id="6-steps")])
def test_batchtap_adds_no_host_read_to_the_trainers_steps(tmp_path, epochs) -> None:
    tap = bt.Tap(sinks=[ListSink()], flush_every=2)
    plain = _reads(tmp_path, tf.Trainer, epochs)
    tapped = _reads(tmp_path, BatchtapTrainer, epochs, tap=tap)
    tap.close()
    assert tap.steps_recorded == 3 * epochs
    assert sum(plain.values()) > 0  # the Trainer's own reads (its final loss...) are counted: the counter works here
    # All batchtap adds, whatever the number of steps: the numpy views of its host buffers, made once
    # at the run's first step (on the CPU the ring is host memory); no read of a step's values.
    assert tapped - plain == Counter({"Tensor.numpy": 3}) and not plain - tapped


def test_the_nan_filter_advice_is_logged_when_the_filter_is_on(tmp_path, caplog) -> None:
    tap = bt.Tap(sinks=[ListSink()])
    args = _args(tmp_path, logging_nan_inf_filter=True, max_steps=1)
    with caplog.at_level("WARNING", logger="batchtap"):
        BatchtapTrainer(model=_gpt2(), args=args, train_dataset=_Data(8, lm=True), tap=tap).train()
    tap.close()
    assert NAN_FILTER_ADVICE in caplog.text and "logging_nan_inf_filter=False" in NAN_FILTER_ADVICE


def test_the_readme_snippet_runs_and_stores_every_step(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_snippet("Hugging Face Trainer"), "README.md", "exec"), {})
    with bt.store.open(os.path.join("runs", "batchtap.db")) as store:
        (run,) = store.runs()
        assert run.status == "finished"
        assert [p.step for p in store.series(run.id, "loss")] == [0, 1, 2, 3]
        assert len(store.series(run.id, "grad_norm")) == 4 and len(store.series(run.id, "accuracy")) == 4
    assert sqlite3.connect(os.path.join("runs", "batchtap.db")).execute("select count(*) from runs").fetchone() == (1,)
