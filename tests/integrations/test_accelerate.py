"""BatchtapTracker with a real Accelerator on the CPU: log_with=, init_trackers, accumulate, end_training."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from batchtap.records import RunStatus
from tests.conftest import ListSink
from tests.integrations._readme import readme_snippet

ROOT = Path(__file__).resolve().parents[2]
accelerate = pytest.importorskip("accelerate")
from batchtap.integrations.accelerate import BatchtapTracker  # noqa: E402


def _setup(tracker: BatchtapTracker, accum: int, n: int = 48, batch_size: int = 8) -> tuple[Any, ...]:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accum, log_with=tracker)
    accelerator.init_trackers("test", config={"lr": 0.1, "accum": accum})
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, loader, sched = accelerator.prepare(
        model, opt, torch.utils.data.DataLoader(data, batch_size=batch_size), sched
    )
    return accelerator, model, opt, loader, sched


@pytest.mark.parametrize("accum", [pytest.param(1, id="no-accumulation"), pytest.param(3, id="accumulate-3")])
def test_the_accumulate_loop_records_one_step_per_optimizer_step_equal_to_the_item_reference(accum) -> None:
    sink = ListSink()
    tracker = BatchtapTracker(bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=2), run_name="acc")
    accelerator, model, opt, loader, sched = _setup(tracker, accum)
    assert accelerator.get_tracker("batchtap") is tracker
    tap = tracker.tap
    reference: list[tuple[float, float, float, float]] = []  # (loss, accuracy, grad norm, lr) with .item()
    micro: list[tuple[float, float]] = []
    for epoch in range(2):
        for x, y in loader:
            with accelerator.accumulate(model):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
                tap.accumulate(loss=loss, outputs=logits, targets=y)
                micro.append((loss.item(), (logits.argmax(1) == y).float().mean().item()))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                lr = opt.param_groups[0]["lr"]
                tap.step(grad_norm=norm, extra={"lr": lr}, epoch=epoch)
                reference.append(
                    (sum(m[0] for m in micro) / len(micro), sum(m[1] for m in micro) / len(micro), norm.item(), lr)
                )
                micro.clear()
        sched.step()
        accelerator.log({"epoch_lr": opt.param_groups[0]["lr"], "note": "strings are not metrics"}, step=None)
    accelerator.end_training()
    tap.close()
    steps = [r for r in sink.records if not r.sparse]
    assert len(steps) == len(reference) == 2 * (6 // accum)  # 6 batches per epoch
    for record, (loss, acc, norm, lr) in zip(steps, reference, strict=True):
        assert record.values["loss"] == pytest.approx(loss, rel=1e-6)  # equal micro-batch sizes: the plain mean
        assert record.values["accuracy"] == pytest.approx(acc, abs=1e-7)
        assert record.values["grad_norm"] == pytest.approx(norm, rel=1e-6)
        assert record.values["lr"] == lr
    logged = [r for r in sink.records if r.sparse]
    assert [r.values for r in logged] == [{"epoch_lr": 0.05}, {"epoch_lr": 0.025}]
    assert [r.step for r in logged] == [steps[len(steps) // 2 - 1].step, steps[-1].step]
    (run,) = sink.ended
    assert run.name == "acc" and run.status is RunStatus.FINISHED and run.config == {"lr": 0.1, "accum": accum}


def test_a_failure_is_stored_with_every_captured_step() -> None:
    sink = ListSink()
    tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=50)
    tracker = BatchtapTracker(tap)
    accelerator, model, opt, loader, _ = _setup(tracker, 1)
    try:
        for i, (x, y) in enumerate(loader):
            if i == 3:
                raise RuntimeError("data went bad")
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            tracker.tap.step(loss=loss)
    except RuntimeError as exc:
        tracker.finish("failed", reason=str(exc))
    tap.close()
    assert [r.step for r in sink.records] == [0, 1, 2]
    assert sink.ended[0].status is RunStatus.FAILED and sink.ended[0].stop_reason == "data went bad"


def test_the_default_tap_is_made_at_first_use_and_closed_by_end_training(monkeypatch) -> None:
    tracker = BatchtapTracker()
    accelerator = accelerate.Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("test")
    tracker.tap.step(loss=torch.tensor(0.5))
    accelerator.log({"val": torch.tensor(0.25)}, step=0)
    accelerator.end_training()
    assert tracker._tap is None  # its own Tap was closed with the run
    with bt.store.open(os.environ["BATCHTAP_DB"]) as store:
        (run,) = store.runs()
        assert run.status == "finished" and [p.value for p in store.series(run.id, "loss")] == [0.5]
        assert [r.values for r in store.sparse_records(run.id)] == [{"val": 0.25}]


def test_the_readme_snippet_runs_and_stores_every_step(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_snippet("Accelerate"), "README.md", "exec"), {})
    with bt.store.open(os.path.join("runs", "batchtap.db")) as store:
        (run,) = store.runs()
        assert run.name == "accelerate" and run.status == "finished" and run.config == {"lr": 0.05}
        assert [p.step for p in store.series(run.id, "loss")] == list(range(8))  # 2 epochs x 8 batches / 2
        assert len(store.series(run.id, "grad_norm")) == 8 and len(store.series(run.id, "accuracy")) == 8
        assert [r.step for r in store.sparse_records(run.id)] == [3, 7]
        # the lr each step used (StepLR halves it every 2 optimizer steps, after the step that used it)
        assert [p.value for p in store.series(run.id, "lr")] == [0.05 * 0.5 ** (k // 2) for k in range(8)]
        assert len(store.series(run.id, "data_time")) == 8  # the loop is watched


def test_two_gloo_ranks_each_drive_their_tap_and_rank_0_stores_the_reduced_steps(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.integrations.accelerate_worker", str(tmp_path)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] for r in range(2)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    starts = [line for line in lines if line["type"] == "run_start"]
    assert len(starts) == 1 and starts[0]["config"] == {"ranks": 2}  # rank 0's init_trackers config
    records = [line for line in lines if line["type"] == "record" and "loss" in line]
    assert [r["step"] for r in records] == list(range(4))  # 64 rows / 2 ranks / 8 per batch / 2 micro x 2 epochs
    for record, a, b in zip(records, *ranks, strict=True):
        assert record["rank"] == -1 and record["loss"] == pytest.approx((a + b) / 2, rel=1e-6)
    logged = [line for line in lines if line["type"] == "record" and "rank_loss" in line]
    assert [r["rank_loss"] for r in logged] == pytest.approx([ranks[0][1], ranks[0][3]], rel=1e-6)  # rank 0's
