"""``bt.sinks.WandB`` in offline mode: real training runs, the ``.wandb`` files W&B wrote read back
record by record; a failed run; the wandb service killed mid-run (spool, restart, resume); the
sink thread; the script's own W&B run left alone."""

from __future__ import annotations

import glob
import math
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import batchtap as bt
from batchtap.errors import ConfigError
from batchtap.records import Event, EventKind, Record, RunInfo
from batchtap.sinks.resilient import ResilientSink
from tests.conftest import ListSink
from tests.sinks._wandb_file import WandbRun, read_run

wandb = pytest.importorskip("wandb")
from batchtap.sinks.wandb import STEP_KEY, WandB  # noqa: E402


def _train(tap: bt.Tap, steps: range, *, nan_at: int = -1) -> None:
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in steps:
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tap.step(loss=loss * math.nan if s == nan_at else loss, outputs=out, targets=y)
        if s % 5 == 4:
            tap.log({"val_loss": loss.detach() / 2})


def _rows(runs: Sequence[WandbRun]) -> list[dict[str, Any]]:
    return [row for run in runs for row in run.history]


def _check_rows(rows: list[dict[str, Any]], seen: ListSink, *, prefix: str = "train/", exact: bool = True) -> None:
    """Every record the ListSink got is a history row: its step, epoch, wall time and values."""
    value_rows = [
        r for r in rows if not any(k.startswith("batchtap/") and k not in (STEP_KEY, "batchtap/epoch") for k in r)
    ]
    got = [
        (r[STEP_KEY], r["_timestamp"], {k: v for k, v in r.items() if not k.startswith(("_", "batchtap/"))})
        for r in value_rows
    ]
    want = []
    for rec in seen.records:
        values = {(k if rec.sparse else prefix + k): v for k, v in rec.values.items()}
        want.append((rec.step, rec.wall_time, values))
    if exact:
        assert len(got) == len(want)
    for w in want:
        assert any(g[0] == w[0] and g[1] == w[1] and _same_values(g[2], w[2]) for g in got), w


def _same_values(a: dict[str, Any], b: dict[str, float]) -> bool:
    if a.keys() != b.keys():
        return False
    # W&B writes NaN as the JSON constant NaN, which json.loads reads back as float nan
    return all((isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(v)) or a[k] == v for k, v in b.items())


def _files(sink: WandB, run_id: str) -> list[WandbRun]:
    wandb.teardown()  # waits until the wandb service wrote every file (a run's finish() may return before)
    paths = sink.files[run_id]
    assert all(os.path.exists(p) for p in paths)
    return [read_run(p) for p in paths]


def test_a_training_run_reads_back_from_the_wandb_file(tmp_path: Path) -> None:
    sink = WandB(project="bt-test", mode="offline", dir=tmp_path)
    seen = ListSink()
    config = {"lr": 0.05, "model": {"layers": 2}}
    with bt.Tap(sinks=[sink, seen], flush_every=4, nan_guard=False) as tap:
        with tap.run("wandb-run", config=config) as info:
            _train(tap, range(12), nan_at=6)
            tap.log({"test_acc": 0.875}, step=2)  # a value for an earlier step
    (run,) = _files(sink, info.id)
    assert (run.run_id, run.name, run.project) == (info.id, "wandb-run", "bt-test")
    assert run.config["lr"] == 0.05 and run.config["model"] == {"layers": 2}
    assert run.step_metrics == {"*": STEP_KEY}  # every chart's x-axis is the batchtap step
    _check_rows(run.history, seen)
    late = [r for r in run.history if "test_acc" in r]
    assert [(r[STEP_KEY], r["test_acc"]) for r in late] == [(2, 0.875)]  # kept at step 2, not dropped
    nan_rows = [r for r in run.history if r.get(STEP_KEY) == 6 and "train/loss" in r]
    assert len(nan_rows) == 1 and math.isnan(nan_rows[0]["train/loss"])
    assert [(r[STEP_KEY], r["batchtap/anomalies"]) for r in run.history if "batchtap/anomalies" in r] == [(6, 1)]
    assert run.summary["batchtap/status"] == "finished" and run.exit_code == 0


def test_a_failed_run_exits_1_with_every_step(tmp_path: Path) -> None:
    sink = WandB(project="bt-test", mode="offline", dir=tmp_path, prefix="")
    seen = ListSink()
    with bt.Tap(sinks=[sink, seen], flush_every=50) as tap:
        with pytest.raises(RuntimeError, match="boom"), tap.run("fails") as info:
            _train(tap, range(7))
            raise RuntimeError("boom")
    (run,) = _files(sink, info.id)
    _check_rows(run.history, seen, prefix="")
    assert run.exit_code == 1
    assert run.summary["batchtap/status"] == "failed" and run.summary["batchtap/stop_reason"] == "RuntimeError: boom"


def _wandb_services() -> list[int]:
    """The wandb-core processes this test process started."""
    kids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        kids += [int(x) for x in Path(path).read_text().split()]
    return [k for k in kids if "wandb-core" in Path(f"/proc/{k}/cmdline").read_bytes().decode(errors="replace")]


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="finds the wandb service through /proc (Linux)")
def test_the_wandb_service_killed_mid_run_loses_nothing(tmp_path: Path) -> None:
    sink = WandB(project="bt-test", mode="offline", dir=tmp_path / "wb")
    seen = ListSink()
    with bt.Tap(sinks=[sink, seen], flush_every=5, spool_dir=tmp_path / "spool") as tap:
        resilient = tap.sinks[0]
        assert isinstance(resilient, ResilientSink)
        with tap.run("outage") as info:
            _train(tap, range(10))
            tap.flush()  # sync: test checkpoint
            services = _wandb_services()
            assert services, "no wandb service process found"
            for pid in services:  # the service this process started, by its id
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            _train(tap, range(10, 20))
            tap.flush()  # sync: test checkpoint
            _train(tap, range(20, 30))
    # a call found the service gone (at the latest finish()), its block was spooled and replayed
    assert resilient.spooled >= 1 and resilient.replayed >= 1 and not resilient.pending
    assert sink.resent >= 10  # the rows the dead service had not written yet, sent again
    runs = _files(sink, info.id)
    assert len(runs) == 2 and runs[1].run_id == info.id  # resumed: the same W&B run id
    assert runs[0].run_id in ("", info.id)  # the killed service may have written nothing at all
    _check_rows(_rows(runs), seen, exact=False)  # a half-written block may be logged twice
    steps = sorted({r[STEP_KEY] for r in _rows(runs) if "train/loss" in r})
    assert steps == list(range(30))
    assert runs[-1].exit_code == 0 and runs[-1].summary["batchtap/status"] == "finished"
    assert any("sink WandB failed" in e.message for e in seen.events if e.kind is EventKind.WARNING)


class _Where(WandB):
    """The real sink, noting the thread of each call the pipeline makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads: set[str] = set()

    def start_run(self, run: RunInfo) -> None:
        self.threads.add(threading.current_thread().name)
        super().start_run(run)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self.threads.add(threading.current_thread().name)
        super().write(records, events)

    def end_run(self, run: RunInfo) -> None:
        self.threads.add(threading.current_thread().name)
        super().end_run(run)


def test_the_sink_thread_only_and_the_scripts_own_run_left_alone(tmp_path: Path) -> None:
    # the script's own run, the usual way: it becomes wandb.run
    own = wandb.init(
        project="mine",
        mode="offline",
        dir=tmp_path / "own",
        id="ownrun",
        settings=wandb.Settings(silent=True, console="off"),
    )
    try:
        sink = _Where(project="bt-test", mode="offline", dir=tmp_path / "bt")
        with bt.Tap(sinks=[sink], flush_every=3) as tap, tap.run("threads") as info:
            _train(tap, range(6))
            tap.flush()  # sync: test checkpoint, the sink's own W&B run is open by now
            wandb.log({"mine": 1.0})  # the script's global wandb.log still reaches its own run
        assert sink.threads == {"batchtap-sink-_Where"}
        assert wandb.run is own
        own_file = own.settings.sync_file
    finally:
        own.finish()
    wandb.teardown()  # waits until the service wrote every file (finish() may return before)
    mine = read_run(own_file)
    assert [{k: v for k, v in r.items() if not k.startswith("_")} for r in mine.history] == [{"mine": 1.0}]
    (ours,) = _files(sink, info.id)
    assert all("mine" not in r for r in ours.history) and len(ours.history) >= 6


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="project must be a non-empty name, got ''"):
        WandB(project="")
    with pytest.raises(ConfigError, match="mode must be 'online', 'offline' or 'disabled', got 'ofline'"):
        WandB(project="p", mode="ofline")  # type: ignore[arg-type]
