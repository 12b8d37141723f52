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


# -- every end of a process stored as what happened ---------------------------------------------
_LOOP = """
import os, sys, time, torch, batchtap as bt
{opening}
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(100_000):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
    {step}
    if i == 5:
        {ending}
"""

_OPENINGS = {
    "explicit-start": ("tap = bt.Tap(flush_every=2); tap.start(name='ends')", "tap.step(loss=loss)"),
    "autolog": ("bt.autolog(name='ends', flush_every=2)", "pass"),
}


def _ends(tmp_path: pathlib.Path, front: str, ending: str, *, sigterm: bool = False) -> tuple[int, str, tuple]:
    opening, step = _OPENINGS[front]
    script = tmp_path / "train.py"
    body = _LOOP.format(opening=opening, step=step, ending=ending)
    script.write_text(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "BATCHTAP_DB": str(tmp_path / "b.db")}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        if sigterm:
            assert proc.stdout is not None
            line = proc.stdout.readline()  # the script prints "ready" and trains on
            assert line.strip() == "ready", line + (proc.stderr.read() if proc.stderr else "")
            proc.send_signal(15)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    with sqlite3.connect(tmp_path / "b.db") as conn:
        row = conn.execute("SELECT status, stop_reason FROM runs").fetchall()
    assert len(row) == 1, row
    return proc.returncode, err, row[0]


@pytest.mark.parametrize("front", list(_OPENINGS))
def test_sigterm_is_stored_stopped_and_ends_the_process_as_sigterm(tmp_path: pathlib.Path, front: str) -> None:
    code, err, (status, reason) = _ends(tmp_path, front, "print('ready', flush=True)", sigterm=True)
    assert (status, reason) == ("stopped", "SIGTERM"), err
    assert code == -15, err  # as the process would have ended without batchtap
    assert "Traceback" not in err and "Terminated" not in err, err


@pytest.mark.parametrize(
    ("ending", "status", "code"),
    [
        pytest.param("sys.exit(3)", "failed", 3, id="exit-3"),
        pytest.param("sys.exit('bad config')", "failed", 1, id="exit-message"),
        pytest.param("sys.exit(0)", "finished", 0, id="exit-0"),
        pytest.param("sys.exit()", "finished", 0, id="exit-none"),
        pytest.param("raise KeyboardInterrupt", "stopped", -2, id="ctrl-c"),  # Python ends by SIGINT
        pytest.param("raise ValueError('boom')", "failed", 1, id="exception"),
    ],
)
def test_autolog_stores_how_the_script_ended(tmp_path: pathlib.Path, ending: str, status: str, code: int) -> None:
    got_code, err, (got_status, reason) = _ends(tmp_path, "autolog", ending)
    assert (got_status, got_code) == (status, code), (reason, err)
    if ending == "sys.exit(3)":
        assert reason == "the script exited with status 3"


def test_spawned_dataloader_workers_never_start_runs(tmp_path: pathlib.Path) -> None:
    """A spawn worker runs the script's top level again (as __mp_main__), bt.autolog() included."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, batchtap as bt
            bt.autolog(name="spawned", flush_every=2)

            class Data(torch.utils.data.Dataset):
                def __len__(self):
                    return 32
                def __getitem__(self, i):
                    g = torch.Generator().manual_seed(i)
                    return torch.randn(4, generator=g), i % 3

            if __name__ == "__main__":
                model = torch.nn.Linear(4, 3)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                loader = torch.utils.data.DataLoader(
                    Data(), batch_size=8, num_workers=2, multiprocessing_context="spawn"
                )
                for epoch in range(2):
                    for x, y in loader:
                        loss = torch.nn.functional.cross_entropy(model(x), y)
                        opt.zero_grad(); loss.backward(); opt.step()
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "BATCHTAP_DB": str(tmp_path / "b.db")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(tmp_path / "b.db") as conn:
        runs = conn.execute("SELECT name, status FROM runs").fetchall()
        steps = conn.execute("SELECT count(*) FROM metrics WHERE metric = 'loss'").fetchone()[0]
    assert runs == [("spawned", "finished")]  # before: one more 0-step run per worker per epoch
    assert steps == 8


@pytest.mark.parametrize(
    ("exc", "status", "reason"),
    [
        pytest.param(None, "finished", None, id="none"),
        pytest.param(KeyboardInterrupt(), "stopped", "KeyboardInterrupt", id="ctrl-c"),
        pytest.param("terminated", "stopped", "SIGTERM", id="sigterm"),
        pytest.param(SystemExit(0), "finished", None, id="exit-0"),
        pytest.param(SystemExit(4), "failed", "the process exited with status 4", id="exit-4"),
        pytest.param(RuntimeError("x"), "failed", "RuntimeError: x", id="error"),
    ],
)
def test_the_integrations_end_a_run_as_training_ended(
    sink: ListSink, exc: BaseException | str | None, status: str, reason: str | None
) -> None:
    from batchtap._exit import Terminated
    from batchtap.integrations._lifecycle import finish_as

    if exc == "terminated":
        exc = Terminated()
    assert not isinstance(exc, str)
    tap = bt.Tap([bt.metrics.Loss()], sinks=[sink])
    tap.start(name="integrated")
    tap.step(loss=torch.tensor(0.5))
    finish_as(tap, exc)
    tap.close()
    assert (sink.ended[-1].status.value, sink.ended[-1].stop_reason) == (status, reason)
