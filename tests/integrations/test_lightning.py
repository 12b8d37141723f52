"""BatchtapCallback driving a real Lightning Trainer on the CPU."""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from batchtap.records import RunStatus
from tests._lightning import quiet_trainer
from tests.conftest import ListSink
from tests.integrations._readme import readme_snippet

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")  # inside Lightning itself
from batchtap.integrations.lightning import BatchtapCallback  # noqa: E402 - after the importorskip


class _Classifier(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, nan_at: int | None = None, with_logits: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        self.seen: list[tuple[float, float]] = []  # (loss, accuracy) read with .item(): the reference

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        if self.global_step == self.hparams.nan_at:
            loss = loss * math.nan
        self.seen.append((loss.item(), (logits.argmax(1) == y).float().mean().item()))
        return {"loss": loss, "logits": logits} if self.hparams.with_logits else loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n: int = 96, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(data, batch_size=batch_size)


def _trainer(callback: BatchtapCallback, epochs: int = 2) -> pl.Trainer:
    return quiet_trainer(
        max_epochs=epochs,
        callbacks=[callback],
    )


def test_every_batch_is_recorded_and_equals_the_item_reference() -> None:
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=4)
    module = _Classifier()
    _trainer(BatchtapCallback(tap, name="lit")).fit(module, _loader())
    tap.close()
    assert [(r.epoch, r.batch) for r in sink.records] == [(e, b) for e in range(2) for b in range(6)]
    assert [(r.values["loss"], r.values["accuracy"]) for r in sink.records] == [
        (pytest.approx(loss, abs=0, rel=1e-7), acc) for loss, acc in module.seen
    ]
    (run,) = sink.ended
    assert run.name == "lit" and run.status is RunStatus.FINISHED and run.config["nan_at"] is None


def test_a_nan_loss_stops_the_trainer_within_two_steps_and_the_run_is_stored_as_stopped() -> None:
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=50)
    module = _Classifier(nan_at=3)
    trainer = _trainer(BatchtapCallback(tap), epochs=5)
    trainer.fit(module, _loader())
    tap.close()
    assert 3 <= trainer.global_step - 1 <= 3 + 2
    assert len(module.seen) <= 3 + 3  # the loop ran at most two batches past the NaN
    assert sink.ended[0].status is RunStatus.STOPPED and "loss" in sink.ended[0].stop_reason
    assert math.isnan(sink.records[3].values["loss"])


def test_a_loss_only_training_step_and_the_default_tap_work() -> None:
    module = _Classifier(with_logits=False)
    callback = BatchtapCallback()
    _trainer(callback, epochs=1).fit(module, _loader())
    assert callback.tap is None  # its own Tap was closed with the run


def test_an_exception_in_training_ends_the_run_as_failed_with_every_step_stored() -> None:
    class Boom(_Classifier):
        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            if batch_idx == 4:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=50)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(BatchtapCallback(tap)).fit(Boom(), _loader())
    tap.close()
    assert [r.step for r in sink.records] == [0, 1, 2, 3]
    assert sink.ended[0].status is RunStatus.FAILED


class _Accumulating(_Classifier):
    """Records the unscaled loss and the gradient norm of every optimizer step with .item()."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, optimizer):  # type: ignore[no-untyped-def]
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))


def test_accumulate_grad_batches_records_one_step_per_optimizer_step_with_lr_grad_norm_and_val_loss() -> None:
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=4)
    module = _Accumulating()
    trainer = quiet_trainer(
        max_epochs=2,
        accumulate_grad_batches=2,
        callbacks=[BatchtapCallback(tap)],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, _loader(), _loader(n=32))
    tap.close()
    steps = [r for r in sink.records if not r.sparse]
    assert [r.step for r in steps] == list(range(trainer.global_step)) == list(range(6))
    for i, record in enumerate(steps):
        (l1, a1), (l2, a2) = module.seen[2 * i], module.seen[2 * i + 1]  # equal batch sizes (16)
        assert record.values["loss"] == pytest.approx((l1 + l2) / 2, rel=1e-6)
        assert record.values["accuracy"] == pytest.approx((a1 + a2) / 2, abs=1e-7)
        assert record.values["grad_norm"] == pytest.approx(module.norms[i], rel=1e-5)
        assert record.values["lr"] == module.lrs[i]
    val = [r for r in sink.records if r.sparse]
    assert len(val) == 2 and all(set(r.values) == {"val_loss"} for r in val)
    assert not [e for e in sink.events if e.kind is bt.EventKind.ANOMALY]


class _Logging(_Classifier):
    """Logs on step (one with prog_bar=True, one named like a step value) and on epoch, reading each with .item()."""

    def __init__(self) -> None:
        super().__init__()
        self.step_logged: list[tuple[float, float, float]] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        out = super().training_step(batch, batch_idx)
        x, y = batch
        margin = self.net(x).max(1).values.mean().detach()
        double = out["loss"].detach() * 2
        self.log("margin", margin, prog_bar=True)  # on_step only in training_step
        self.log("loss", double)  # clashes with batchtap's own per-step loss
        self.log("mean_loss", out["loss"].detach(), on_step=False, on_epoch=True)
        self.step_logged.append((margin.item(), double.item(), out["loss"].item()))
        return out


def _fit_reads(module: pl.LightningModule, callbacks: list[Any]) -> Counter[str]:
    trainer = quiet_trainer(
        max_epochs=2,
        callbacks=callbacks,
    )
    with HostReadCounter() as reads:
        trainer.fit(module, _loader())
    return Counter(r.op for r in reads.reads)


def test_self_log_values_are_stored_per_optimizer_step_and_epoch_without_a_host_read() -> None:
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=4)
    plain = _fit_reads(_Logging(), [])
    module = _Logging()
    tapped = _fit_reads(module, [BatchtapCallback(tap)])
    tap.close()
    logged = [r for r in sink.records if r.sparse]
    per_step = [r for r in logged if "margin" in r.values]
    assert [r.step for r in per_step] == list(range(12))
    for record, (margin, double, _) in zip(per_step, module.step_logged, strict=True):
        assert record.values == {
            "margin": pytest.approx(margin, rel=1e-6),
            "logged_loss": pytest.approx(double, rel=1e-6),
        }
    per_epoch = [r for r in logged if "mean_loss" in r.values]
    assert [r.step for r in per_epoch] == [5, 11]
    for record, epoch in zip(per_epoch, range(2), strict=True):
        losses = [loss for _, _, loss in module.step_logged[6 * epoch : 6 * epoch + 6]]
        assert record.values["mean_loss"] == pytest.approx(sum(losses) / 6, rel=1e-6)
    # All the callback adds (lr, grad norm and self.log values included): the numpy views of the
    # Tap's host buffers, made once at the run's first step; the module's own .item() reads are in both.
    assert sum(plain.values()) > 0 and tapped - plain == Counter({"Tensor.numpy": 3}) and not plain - tapped


def test_a_failure_in_the_sanity_check_is_stored_as_failed() -> None:
    class BadValidation(_Classifier):
        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            raise ValueError("bad validation")

    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss()], [sink])
    trainer = quiet_trainer(
        max_epochs=1,
        callbacks=[BatchtapCallback(tap)],
    )
    with pytest.raises(ValueError, match="bad validation"):
        trainer.fit(BadValidation(), _loader(), _loader(n=16))
    tap.close()
    assert sink.records == [] and sink.ended[0].status is RunStatus.FAILED
    assert sink.ended[0].stop_reason == "ValueError: bad validation"


class CliClassifier(pl.LightningModule):  # type: ignore[misc]
    """A module written for LightningCLI: typed init arguments, its own optimizer and scheduler."""

    def __init__(self, hidden: int = 16, lr: float = 0.1, gamma: float = 0.5) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))
        self.norms: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return {"loss": loss, "logits": logits}

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def on_before_optimizer_step(self, optimizer):  # type: ignore[no-untyped-def]
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=self.hparams.gamma)}


class CliData(pl.LightningDataModule):  # type: ignore[misc]
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return _loader(batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return _loader(n=32, batch_size=self.batch_size)


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter", "ignore::DeprecationWarning")
def test_lightning_cli_with_the_callback_from_the_command_line_stores_lr_grad_norm_and_logged_values(tmp_path) -> None:
    cli_module = pytest.importorskip("lightning.pytorch.cli")
    pytest.importorskip("jsonargparse")
    args = [
        "--model.lr=0.2",
        "--data.batch_size=16",
        "--trainer.max_epochs=2",
        "--trainer.accelerator=cpu",
        "--trainer.accumulate_grad_batches=3",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=batchtap.integrations.lightning.BatchtapCallback",
        "--trainer.callbacks.name=cli-run",
    ]
    cli = cli_module.LightningCLI(CliClassifier, CliData, args=args, run=False, save_config_callback=None)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, BatchtapCallback)]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert callback.tap is None  # the default Tap it made was closed with the run
    with bt.store.open(os.environ["BATCHTAP_DB"]) as store:
        (run,) = store.runs()
        assert run.name == "cli-run" and run.status == "finished" and run.config["lr"] == 0.2
        assert [p.step for p in store.series(run.id, "loss")] == list(range(cli.trainer.global_step)) == list(range(4))
        assert [p.value for p in store.series(run.id, "grad_norm")] == pytest.approx(cli.model.norms, rel=1e-5)
        assert [p.value for p in store.series(run.id, "lr")] == cli.model.lrs == [0.2, 0.2, 0.1, 0.1]
        sparse = store.sparse_records(run.id)
        assert sorted(n for r in sparse for n in r.values) == ["train_loss", "train_loss", "val_acc", "val_acc"]


def test_the_readme_snippet_runs_and_stores_every_step(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_snippet("Lightning"), "README.md", "exec"), {"__name__": "readme"})
    with bt.store.open(os.path.join("runs", "batchtap.db")) as store:
        (run,) = store.runs()
        assert run.name == "lightning" and run.status == "finished"
        assert [p.step for p in store.series(run.id, "loss")] == list(range(8))  # 2 epochs x 8 batches / 2
        assert len(store.series(run.id, "lr")) == 8 and len(store.series(run.id, "grad_norm")) == 8
        assert [r.step for r in store.sparse_records(run.id)] == [3, 7]


def test_autolog_under_lightnings_fit_loop_numbers_every_epoch_and_times_every_batch() -> None:
    """Lightning's fit loop knows each epoch's length, so it never asks the old epoch's DataLoader
    iterator past its last batch, and it makes the next epoch's iterator while still holding the old
    one: under ``bt.autolog()`` every step after epoch 0 was stored with epoch 0, batch = step and no
    data time. Each step's (epoch, batch), its data wait and its loss against the module's .item()."""
    from batchtap.autolog import active_session

    sink = ListSink()
    module = _Classifier()
    tap = bt.autolog(sinks=[sink], name="lit-autolog", flush_every=4)
    assert tap is not None
    try:
        quiet_trainer(
            max_epochs=3,
        ).fit(module, _loader())
    finally:
        bt.autolog(enabled=False)
    assert active_session() is None
    rows = [r for r in sink.records if not r.sparse]
    assert [(r.epoch, r.batch) for r in rows] == [(e, b) for e in range(3) for b in range(6)]
    assert all(r.values["data_time"] >= 0 for r in rows), [r.values.keys() for r in rows]
    assert [r.values["loss"] for r in rows] == [pytest.approx(loss, rel=1e-6) for loss, _ in module.seen]
