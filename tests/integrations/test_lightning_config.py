"""Issue 29 item 5: a Lightning run stores the Trainer's settings (accumulation, precision, ...) with
the module's hyperparameters, and no LightningCLI-internal ``_instantiator`` key; a real Trainer
and a real LightningCLI on the CPU."""

from __future__ import annotations

import os

import pytest

import batchtap as bt
from tests.conftest import ListSink

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")
from batchtap.integrations.lightning import BatchtapCallback  # noqa: E402
from tests.integrations.test_lightning import CliClassifier, CliData, _Classifier, _loader  # noqa: E402


def test_the_trainers_settings_are_stored_under_trainer() -> None:
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=4)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[BatchtapCallback(tap, name="ga")],
    )
    trainer.fit(_Classifier(), _loader())
    tap.close()
    config = sink.ended[0].config
    assert config["nan_at"] is None and config["with_logits"] is True  # the module's hyperparameters
    settings = config["trainer"]
    assert settings["accumulate_grad_batches"] == 2 and settings["gradient_clip_val"] == 0.5
    assert settings["max_epochs"] == 1 and settings["precision"] == "32-true"
    assert settings["accelerator"] == "CPUAccelerator"


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter", "ignore::DeprecationWarning")
def test_a_lightning_cli_run_stores_its_trainer_settings_and_no_internal_key(tmp_path) -> None:
    cli_module = pytest.importorskip("lightning.pytorch.cli")
    pytest.importorskip("jsonargparse")
    args = [
        "--model.lr=0.2",
        "--trainer.max_epochs=1",
        "--trainer.accelerator=cpu",
        "--trainer.accumulate_grad_batches=3",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=batchtap.integrations.lightning.BatchtapCallback",
        "--trainer.callbacks.name=cli-config",
    ]
    cli = cli_module.LightningCLI(CliClassifier, CliData, args=args, run=False, save_config_callback=None)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    with bt.store.open(os.environ["BATCHTAP_DB"]) as store:
        run = store.run("cli-config")
    assert run.config["lr"] == 0.2 and run.config["hidden"] == 16
    assert not [k for k in run.config if k.startswith("_")], run.config
    assert run.config["trainer"]["accumulate_grad_batches"] == 3
