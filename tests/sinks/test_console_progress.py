"""The Console's progress bar: total, percentage and time left from the watched loader's length, a
rate that is the training speed (from the steps' wall times), and the script's own prints never on
the bar's line nor batchtap's lines on the script's: a real training script on a pseudo-terminal,
its output rendered as a terminal shows it."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.records import Record, RunInfo, RunStatus
from batchtap.sinks._terminal import GuardedStdout
from batchtap.sinks.console import Console
from tests.sinks._screen import render

REPO = Path(__file__).resolve().parents[2]


def _records(epoch: int, batches: range, t0: float, dt: float) -> list[Record]:
    return [Record("r1", epoch * 100 + b, epoch, b, 0, t0 + b * dt, {"loss": 0.5}) for b in batches]


def test_bar_shows_total_percentage_time_left_and_the_training_rate() -> None:
    out = io.StringIO()
    console = Console(stream=out, live=True, guard_stdout=False)
    console.start_run(RunInfo("r1", "bar", {}, started_at=0.0))
    console.start_epoch("r1", 0, 100)
    # 20 batches at 25 per second, delivered in one block (as a flush delivers them) long after
    console.write(_records(0, range(20), t0=1000.0, dt=0.04))
    bar = console._bar
    assert bar is not None and bar.total == 100 and bar.n == 20
    assert bar.rate == pytest.approx(25.0)  # steps' wall times, not arrival times
    shown = render(out.getvalue())[-1]
    assert "epoch 0:  20%" in shown and "20/100" in shown
    assert "25.00batch/s" in shown and "<00:03," in shown  # 80 batches left at 25/s: 3.2 s
    # the speed changes: the rate follows the last rate_window (10 s) of steps
    console.write(_records(0, range(20, 60), t0=1000.0 + 20 * 0.04 - 20 * 0.5, dt=0.5))
    assert console._bar is not None and console._bar.rate == pytest.approx(2.0)
    console.end_run(RunInfo("r1", "bar", {}, started_at=0.0, status=RunStatus.FINISHED))


def test_a_loader_without_length_counts_without_percentage() -> None:
    out = io.StringIO()
    console = Console(stream=out, live=True, guard_stdout=False)
    console.start_run(RunInfo("r1", "bar", {}, started_at=0.0))
    console.start_epoch("r1", 0, None)
    console.write(_records(0, range(7), t0=5.0, dt=0.1))
    shown = render(out.getvalue())[-1]
    assert "epoch 0: 7batch" in shown and "%" not in shown.split("[")[0] and "10.00batch/s" in shown
    console.close()


def test_a_block_spanning_two_epochs_finishes_the_first_bar() -> None:
    out = io.StringIO()
    console = Console(stream=out, live=True, guard_stdout=False)
    console.start_run(RunInfo("r1", "bar", {}, started_at=0.0))
    console.start_epoch("r1", 0, 10)
    console.start_epoch("r1", 1, 10)
    console.write(_records(0, range(8), 0.0, 0.1))
    console.write(_records(0, range(8, 10), 0.8, 0.1) + _records(1, range(3), 1.0, 0.1))
    lines = render(out.getvalue())
    assert any(line.startswith("epoch 0: 100%") and "10/10" in line for line in lines)
    assert lines[-1].startswith("epoch 1:  30%")
    console.close()


def test_tap_watch_tells_the_console_the_loader_length(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(12)]
    with bt.Tap(sinks=[Console(stream=out, live=True)], flush_every=5) as tap, tap.run("watched"):
        for _ in range(2):
            for x, y in tap.watch(loader):
                o = model(x)
                loss = torch.nn.functional.cross_entropy(o, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                tap.step(loss=loss, outputs=o, targets=y)
    lines = render(out.getvalue())
    for epoch in (0, 1):
        assert any(line.startswith(f"epoch {epoch}: 100%") and "12/12" in line for line in lines), lines


def test_stdout_is_guarded_only_while_a_run_is_shown() -> None:
    before = sys.stdout
    console = Console(stream=io.StringIO(), live=True)
    console.start_run(RunInfo("r1", "g", {}, started_at=0.0))
    assert isinstance(sys.stdout, GuardedStdout) and sys.stdout.wrapped is before
    console.end_run(RunInfo("r1", "g", {}, started_at=0.0, status=RunStatus.FINISHED))
    assert sys.stdout is before


SCRIPT = textwrap.dedent(
    """
    import torch, batchtap as bt
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(40)]
    with bt.Tap(sinks=[bt.sinks.Console()], flush_every=3, flush_seconds=0.001) as tap, tap.run("pty"):
        for epoch in range(2):
            for i, (x, y) in enumerate(tap.watch(loader)):
                out = model(x)
                loss = torch.nn.functional.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                tap.step(loss=loss, outputs=out, targets=y)
                if i % 4 == 3:
                    print(f"user line {epoch}-{i}")
                if i % 10 == 5:
                    print("partial", end="", flush=True)
                    tap.flush()  # the console writes while the script's line is unfinished
                    print(" and the rest of it")
            tap.log({"val_loss": loss.detach()})
    print("script done")
    """
)


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_prints_never_share_a_line_with_the_console_on_a_terminal(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env["BATCHTAP_DB"] = str(tmp_path / "bt.db")
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the script exited and closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    lines = render(b"".join(chunks).decode())
    user = [line for line in lines if "user line" in line or "partial" in line or "script done" in line]
    expected = [f"user line {e}-{i}" for e in range(2) for i in range(40) if i % 4 == 3]
    assert [line for line in user if line.startswith("user line")] == expected  # each whole, alone
    assert user.count("partial and the rest of it") + sum(line == "partial" for line in user) >= 8
    for line in user:  # nothing of the bar or of batchtap's lines on the script's lines
        assert "batch/s" not in line and "batchtap" not in line and "eval" not in line and "|" not in line, line
    for line in lines:
        if "batch/s" in line:
            assert re.fullmatch(r"epoch \d: +\d+%\|.*\| \d+/40 \[.*batch/s.*", line), line
    assert any(line.startswith("epoch 0: 100%") and "40/40" in line for line in lines)
    assert any(line.startswith("epoch 1: 100%") and "40/40" in line for line in lines)
    assert sum(line.startswith("eval  step") for line in lines) == 2
    assert lines[-1] == "script done"


LOG_SCRIPT = textwrap.dedent(
    """
    import torch, batchtap as bt
    with bt.Tap([bt.metrics.Loss()], sinks=[bt.sinks.Console(every=1)], flush_every=1) as tap, tap.run("log"):
        for i in range(1500):
            tap.step(loss=torch.tensor(1.0))
            print(f"user line {i:05d} " + "x" * 40)
            if i % 100 == 50:
                print("partial", end="", flush=True)  # as progress dots are printed
                tap.flush()  # sync: the console writes while the script's line is unfinished
                print(" and the rest of it")
    """
)


def test_prints_never_share_a_line_with_the_console_in_a_log_file(tmp_path: Path) -> None:
    """`python train.py > log 2>&1`: stdout block-buffered, stderr not, one file."""
    script = tmp_path / "train.py"
    script.write_text(LOG_SCRIPT)
    log = tmp_path / "train.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env["BATCHTAP_DB"] = str(tmp_path / "bt.db")
    with log.open("wb") as f:
        done = subprocess.run(
            [sys.executable, str(script)], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=300, check=False
        )
    assert done.returncode == 0
    lines = log.read_text().splitlines()
    user = [line for line in lines if "user line" in line]
    assert user == [f"user line {i:05d} " + "x" * 40 for i in range(1500)]  # each whole, on its own
    console = [line for line in lines if line.startswith("epoch 0 batch")]
    assert len(console) == 1500 and all(re.fullmatch(r"epoch 0 batch \d+: loss=1\.0000", line) for line in console)
    assert all(
        line in ("partial", "partial and the rest of it", " and the rest of it")
        for line in lines
        if "partial" in line or "rest of it" in line
    )
