"""What a person sees on a terminal: the Console under a real pseudo-terminal at 80, 200 and 0
columns (screen content asserted), numbers and units, one line per anomaly in step order, and a
closed stdout (``batchtap demo | head -3``) that changes nothing of the run."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import sqlite3
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest

from batchtap._defaults import checked_sinks
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks import JSONL, Console
from batchtap.sinks.resilient import ResilientSink
from tests.sinks._screen import render

REPO = Path(__file__).resolve().parents[2]
FIELDS = ("loss=", "acc=", "lr=", "gnorm=", "step=", "data=", "tput=")

SCRIPT = textwrap.dedent(
    """
    import torch, batchtap as bt
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(30)]
    tap = bt.Tap(optimizer=opt, model=model, sinks=[bt.sinks.Console(every=10)], flush_every=4, flush_seconds=0.001)
    with tap, tap.run("pty"):
        for epoch in range(2):
            for i, (x, y) in enumerate(tap.watch(loader, epoch=epoch)):
                out = model(x)
                loss = torch.nn.functional.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                tap.step(loss=loss, outputs=out, targets=y)
            print(f"user line {epoch}")
    print("script done")
    """
)


def _run_on_pty(tmp_path: Path, columns: int) -> str:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("COLUMNS", None)
    env["TERM"] = "xterm"
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
    assert proc.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode()


pty_only = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")


@pty_only
def test_80_columns_fit_every_field_on_a_second_line_and_a_real_bar(tmp_path: Path) -> None:
    lines = render(_run_on_pty(tmp_path, 80), columns=80)
    assert all(len(line) < 80 for line in lines), [line for line in lines if len(line) >= 80]
    for epoch in (0, 1):  # each epoch's final bar stays on screen, its values under it
        at = next(i for i, line in enumerate(lines) if line.startswith(f"epoch {epoch}: 100%"))
        bar = lines[at]
        assert "30/30" in bar and "batch/s" in bar
        assert len(re.search(r"\|(.*)\|", bar).group(1)) >= 20, bar  # a bar, not 1 character
        values = []
        for line in lines[at + 1 :]:
            if not line.startswith("  "):
                break
            values.append(line)
        assert values and all(f in " ".join(values) for f in FIELDS), (bar, values)
    assert lines.index("user line 0") < lines.index("user line 1") < lines.index("script done")
    assert re.search(r"step=\d+\.\d\dms", "\n".join(lines)) and re.search(r"tput=\d+/s", "\n".join(lines))


@pty_only
def test_200_columns_show_bar_and_values_on_one_line(tmp_path: Path) -> None:
    lines = render(_run_on_pty(tmp_path, 200), columns=200)
    finals = [line for line in lines if re.match(r"epoch \d: 100%", line)]
    assert len(finals) == 2
    for line in finals:
        assert len(line) < 200 and all(f in line for f in FIELDS), line
    assert lines[-1] == "script done"


@pty_only
def test_a_terminal_of_0_columns_gets_plain_lines(tmp_path: Path) -> None:
    raw = _run_on_pty(tmp_path, 0)
    assert "\x1b[" not in raw  # nothing redrawn: there is no width to draw in
    lines = render(raw)
    steps = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in steps] == [f"epoch {e} batch {b}" for e in (0, 1) for b in (0, 10, 20)]
    assert all(all(f in line for f in ("loss=", "acc=", "lr=", "gnorm=")) for line in steps)
    assert "" not in lines[1:]  # no blank lines
    assert lines[-1] == "script done"


def _records(values: list[dict[str, float]]) -> list[Record]:
    return [Record("r1", i, 0, i, 0, 1000.0 + i, v) for i, v in enumerate(values)]


def test_numbers_are_formatted_for_their_size_with_units() -> None:
    out = io.StringIO()
    console = Console(every=1, stream=out, live=False, guard_stdout=False)
    console.start_run(RunInfo("r1", "n", {}, started_at=0.0))
    console.write(_records([{"loss": 746546450229347435969836482560.0, "step_time": 0.0016341, "grad_norm": 3.2e-7}]))
    assert out.getvalue().splitlines()[1] == "epoch 0 batch 0: loss=7.5e+29 step=1.63ms gnorm=3.2e-07"


def test_a_step_s_anomalies_are_one_line_and_lines_come_in_step_order() -> None:
    out = io.StringIO()
    console = Console(every=100, stream=out, live=False, guard_stdout=False)
    console.start_run(RunInfo("r1", "a", {}, started_at=0.0))

    def anomaly(step: int, metric: str) -> Event:
        message = f"{metric}=nan at step {step} is not a number (expected [0, inf] (finite)); stored as NaN"
        return Event("r1", step, EventKind.ANOMALY, message, 0.0, metric, float("nan"))

    events = [anomaly(54, "loss"), anomaly(40, "loss"), anomaly(40, "grad_norm"), anomaly(40, "accuracy")]
    events += [anomaly(51, "loss"), Event("r1", 40, EventKind.ACTION, "stop: loss is NaN at step 40", 0.0)]
    console.write([], events)
    lines = out.getvalue().splitlines()[1:]
    assert lines == [
        "batchtap anomaly at step 40: loss=nan is not a number (expected [0, inf] (finite)); stored as NaN; "
        "grad_norm=nan is not a number (expected [0, inf] (finite)); stored as NaN; "
        "accuracy=nan is not a number (expected [0, inf] (finite)); stored as NaN",
        "batchtap action at step 40: stop: loss is NaN",
        "batchtap anomaly at step 51: loss=nan is not a number (expected [0, inf] (finite)); stored as NaN",
        "batchtap anomaly at step 54: loss=nan is not a number (expected [0, inf] (finite)); stored as NaN",
    ]
    assert all(line.count("step 40") <= 1 for line in lines)
    console.end_run(RunInfo("r1", "a", {}, started_at=0.0, status=RunStatus.STOPPED))
    assert out.getvalue().splitlines()[-1].endswith("anomalies: 5")  # every event counted


def test_the_console_is_never_spooled(tmp_path: Path) -> None:
    console, jsonl = Console(live=False), JSONL(tmp_path / "m.jsonl")
    wrapped = checked_sinks([console, jsonl], tmp_path / "spool", rank=0)
    assert wrapped[0] is console and isinstance(wrapped[1], ResilientSink)


def test_a_closed_stream_is_dropped_not_raised() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader went away, as `| head` does
    stream = os.fdopen(write, "w", buffering=1)
    console = Console(every=1, stream=stream, live=False, guard_stdout=False)
    console.start_run(RunInfo("r1", "closed", {}, started_at=0.0))
    console.write(_records([{"loss": 0.5}] * 3))
    console.end_run(RunInfo("r1", "closed", {}, started_at=0.0, status=RunStatus.FINISHED))
    assert console._closed_stream
    stream.close()  # its buffer went to /dev/null: no BrokenPipeError at close either


def test_demo_piped_into_head_stores_every_step_as_finished_and_the_next_run_replays_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    demo = f"{sys.executable} -m batchtap.cli.main demo --epochs 3 --out {tmp_path / 'runs'}"
    head = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {demo} 2>&1 | head -3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert head.returncode == 0, head.stderr  # the demo itself exited 0 (pipefail)
    assert len(head.stdout.splitlines()) == 3
    db = sqlite3.connect(tmp_path / "runs" / "batchtap.db")
    ((status, reason),) = db.execute("SELECT status, stop_reason FROM runs").fetchall()
    assert (status, reason) == ("finished", None)
    (steps,) = db.execute("SELECT COUNT(DISTINCT step) FROM metrics").fetchone()
    assert steps == 3 * 45  # 1437 training digits, batches of 32: 45 a epoch
    db.close()
    spool = tmp_path / "runs" / "spool"
    assert not any("console" in p.name for p in spool.glob("*")) if spool.exists() else True
    again = subprocess.run(
        [*demo.split(), "--epochs", "1"], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert again.returncode == 0, again.stderr
    assert "replayed" not in again.stderr and "recovered" not in again.stderr, again.stderr


ORDER_SCRIPT = textwrap.dedent(
    """
    import torch, batchtap as bt
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(25)]
    tap = bt.Tap(sinks=[bt.sinks.Console(every=5)], flush_every=10, flush_seconds=60)
    with tap, tap.run("order"):
        for epoch in range(3):
            for x, y in tap.watch(loader, epoch=epoch):
                out = model(x)
                loss = torch.nn.functional.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                tap.step(loss=loss, outputs=out, targets=y)
            print(f"user: epoch {epoch} done", flush=True)
    print("script done")
    """
)


def test_plain_lines_and_the_script_s_prints_in_one_file_come_in_step_order(tmp_path: Path) -> None:
    """`python train.py > log 2>&1`: the console's lines of an epoch come a flush late (here up to
    10 steps); the script's print after that epoch still comes after them."""
    script = tmp_path / "train.py"
    script.write_text(ORDER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env["BATCHTAP_DB"] = str(tmp_path / "bt.db")
    log = tmp_path / "train.log"
    with log.open("wb") as f:
        done = subprocess.run([sys.executable, str(script)], stdout=f, stderr=subprocess.STDOUT, env=env, timeout=300)
    assert done.returncode == 0, log.read_text()[-2000:]
    lines = [line for line in log.read_text().splitlines() if line.startswith(("epoch ", "user:", "script done"))]
    expected = []
    for epoch in range(3):
        expected += [f"epoch {epoch} batch {b}" for b in range(0, 25, 5)] + [f"user: epoch {epoch} done"]
    assert [line.split(":")[0] if line.startswith("epoch") else line for line in lines] == [*expected, "script done"]
