"""Run life cycle beyond ``with tap.run()``: start()/finish(), interpreter exit, resume, defaults,
configs, torch.compile."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import pathlib
import sqlite3
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import batchtap as bt
from tests.conftest import ListSink

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_start_and_finish_without_a_with_block(sink: ListSink) -> None:
    tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=3)
    info = tap.start(name="script-level")
    for i in range(7):  # a script's top-level loop, not re-indented under `with`
        tap.step(loss=torch.tensor(float(i)))
    tap.finish()
    assert [r.values["loss"] for r in sink.records] == [float(i) for i in range(7)]
    assert sink.ended[-1].id == info.id and sink.ended[-1].status is bt.RunStatus.FINISHED
    info2 = tap.start(name="second")
    tap.step(loss=torch.tensor(1.0))
    tap.finish("failed", reason="eval crashed")
    assert (sink.ended[-1].id, sink.ended[-1].status, sink.ended[-1].stop_reason) == (
        info2.id,
        bt.RunStatus.FAILED,
        "eval crashed",
    )
    tap.close()
    with pytest.raises(bt.RunStateError, match="outside a run"):
        tap.finish()


def test_finish_keeps_a_stop_reason(sink: ListSink) -> None:
    tap = bt.Tap([bt.metrics.Loss()], [sink])
    tap.start()
    tap.step(loss=torch.tensor(float("nan")))
    assert tap.should_stop
    tap.finish()
    tap.close()
    assert sink.ended[-1].status is bt.RunStatus.STOPPED and "non-finite loss" in sink.ended[-1].stop_reason


def _run_script(body: str, tmp_path: pathlib.Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "BATCHTAP_DB": str(tmp_path / "b.db")}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("form", ["start", "entered-run-context"])
def test_a_run_left_open_at_interpreter_exit_is_stored_as_failed_without_hanging(
    tmp_path: pathlib.Path, form: str
) -> None:
    opening = (
        "tap.start(name='open')"
        if form == "start"
        else "opened = tap.run(name='open'); opened.__enter__()  # a notebook cell that entered the block"
    )
    done = _run_script(
        f"""
        import torch, batchtap as bt
        tap = bt.Tap([bt.metrics.Loss()], flush_every=1000)
        {opening}
        for i in range(25):
            tap.step(loss=torch.tensor(float(i)))
        print("loop done")
        # no finish(): the notebook / script just ends
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(tmp_path / "b.db") as conn:
        status, reason = conn.execute("SELECT status, stop_reason FROM runs").fetchone()
        steps = conn.execute("SELECT count(*) FROM metrics WHERE metric = 'loss'").fetchone()[0]
    assert status == "failed" and "finish() was never called" in reason
    assert steps == 25  # every captured step stored


def test_exit_with_a_stuck_sink_is_bounded_by_exit_timeout(tmp_path: pathlib.Path) -> None:
    done = _run_script(
        """
        import time, torch, batchtap as bt

        class Stuck(bt.sinks.Sink):
            def write(self, records, events=()):
                time.sleep(3600)

        tap = bt.Tap([bt.metrics.Loss()], [Stuck()], flush_every=1, exit_timeout=1.0)
        tap.start()
        for i in range(3):
            tap.step(loss=torch.tensor(1.0))
        t0 = time.monotonic()
        import atexit
        atexit.register(lambda: print(f"atexit ran", flush=True))
        """,
        tmp_path,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_resume_keeps_the_stored_name(tmp_path: pathlib.Path) -> None:
    db = tmp_path / "r.db"
    with bt.Tap([bt.metrics.Loss()], [bt.sinks.SQLite(db)]) as tap:
        with tap.run(name="long-job") as first:
            for _ in range(5):
                tap.step(loss=torch.tensor(1.0))
        with tap.run(resume=first.id) as resumed:  # no name=: keep the stored one
            tap.step(loss=torch.tensor(1.0))
    assert resumed.name == "long-job"
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT name FROM runs WHERE id = ?", (first.id,)).fetchone() == ("long-job",)
        assert conn.execute("SELECT max(step) FROM metrics WHERE run_id = ?", (first.id,)).fetchone() == (5,)


def test_a_tap_without_sinks_stores_to_sqlite_and_batchtap_runs_shows_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BATCHTAP_DB")
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bt.Tap(optimizer=opt, model=model) as tap, tap.run(name="defaults") as info:
        for _ in range(3):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            loss.backward()
            opt.step()
            tap.step(loss=loss, outputs=out, targets=y)
            opt.zero_grad()
    assert (tmp_path / "runs" / "batchtap.db").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHTAP_DB")}
    shown = subprocess.run(
        [sys.executable, "-m", "batchtap.cli.main", "runs"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert info.id[:8] in shown.stdout and "defaults" in shown.stdout


class Optim(enum.Enum):
    ADAMW = "adamw"


@dataclasses.dataclass
class TrainConfig:
    lr: float = 3e-4
    out_dir: pathlib.Path = pathlib.Path("out")
    dtype: torch.dtype = torch.bfloat16
    optim: Optim = Optim.ADAMW


def test_everyday_config_objects_are_stored_as_json(sink: ListSink) -> None:
    args = argparse.Namespace(
        batch_size=64,
        device=torch.device("cpu"),
        data=pathlib.Path("/data/shakespeare"),
        betas=(0.9, 0.95),
        train=TrainConfig(),
        decay=float("inf"),
    )
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap:
        with tap.run(config=args) as info:
            pass
        with tap.run(config=TrainConfig()) as info2:
            pass
    assert info.config == {
        "batch_size": 64,
        "device": "cpu",
        "data": "/data/shakespeare",
        "betas": [0.9, 0.95],
        "train": {"lr": 3e-4, "out_dir": "out", "dtype": "torch.bfloat16", "optim": "adamw"},
        "decay": "inf",
    }
    assert info2.config["dtype"] == "torch.bfloat16"
    assert not sink.events  # nothing had to fall back to repr


def test_step_inside_a_compiled_function_does_not_recompile(sink: ListSink) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model = torch.nn.Linear(8, 3)
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=5)

    @torch.compile(backend="aot_eager")
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        tap.step(loss=loss, outputs=out, targets=y)
        return loss

    expected = []
    from torch._dynamo.utils import counters

    counters.clear()
    with warnings.catch_warnings(record=True) as caught, tap, tap.run():
        warnings.simplefilter("always")
        for _ in range(12):
            x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
            expected.append(train_step(x, y).item())
    # dynamo neither traced into batchtap nor tried to compile its call wrapper
    assert not [str(w.message) for w in caught if "batchtap" in str(w.message) or "eval_frame" in str(w.message)]
    assert [r.values["loss"] for r in sink.records] == pytest.approx(expected, rel=1e-6)
    recompiles = sum(v for k, v in counters["recompiles"].items()) if "recompiles" in counters else 0
    assert recompiles == 0, dict(counters["recompiles"])
    assert counters["stats"]["unique_graphs"] <= 3  # graph breaks around tap.step, not a graph per step
