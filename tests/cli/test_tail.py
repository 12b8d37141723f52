"""`batchtap tail`: follows a run another process is writing, and exits when it ends."""

from __future__ import annotations

import os
import pty
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import batchtap.store
from batchtap.cli.main import main
from batchtap.records import RunInfo
from batchtap.sinks.sqlite import SQLite
from tests.cli.conftest import TRAIN, Runs, cli, popen

STEP = re.compile(r"^step=(\d+) epoch=(\d+) batch=(\d+) ")
TIMEOUT = 180  # generous: a loaded CI box; nothing below asserts a duration


class Lines:
    """A process's output lines, read on a thread so the test can wait for one."""

    def __init__(self, stream: object) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def wait_for(self, pattern: str) -> str:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"stream ended before {pattern!r}; got {self.seen}")
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no {pattern!r} in {self.seen}")

    def rest(self) -> list[str]:
        while (line := self.q.get(timeout=TIMEOUT)) is not None:
            self.seen.append(line)
        return self.seen


def _steps(lines: list[str]) -> list[int]:
    return [int(m[1]) for line in lines if (m := STEP.match(line))]


def tail_proc(db: Path | str, run: str, *extra: str) -> subprocess.Popen[str]:
    return popen(
        [sys.executable, "-m", "batchtap.cli.main", "tail", run, "--db", str(db), "--interval", "0.1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def writer_proc(db: Path | str, name: str, *extra: str) -> subprocess.Popen[str]:
    return popen(
        [sys.executable, str(TRAIN), "--db", str(db), "--name", name, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def follow_from_before_the_run(
    db: Path | str, procs: list[subprocess.Popen[str]], *, schema: str | None = None
) -> None:
    """Start tail first (it waits for the run), then the writer; tail prints every step once and exits."""
    name = f"tail-{uuid.uuid4().hex[:8]}"
    where = ("--schema", schema) if schema else ()
    tail = tail_proc(db, name, "--wait", str(TIMEOUT), *where)
    procs.append(tail)
    Lines(tail.stderr).wait_for("waiting up to")  # tail is polling: nothing has been written yet
    out = Lines(tail.stdout)
    writer = writer_proc(db, name, "--sleep", "0.02", "--nan-at", "5", *where)
    procs.append(writer)
    assert writer.wait(timeout=TIMEOUT) == 0, writer.stderr.read() if writer.stderr else ""
    lines = out.rest()
    assert tail.wait(timeout=TIMEOUT) == 0
    assert _steps(lines) == list(range(36)), lines  # every step, once, in order
    assert lines[0].startswith(f"# run {name} (")
    assert any(line.startswith("! step 5 anomaly loss:") for line in lines)
    assert re.match(rf"# run {name} \(\w+\) finished at step 35 after ", lines[-1]), lines[-1]
    first = next(line for line in lines if STEP.match(line))
    assert "loss=" in first and "accuracy=" in first and "lr=0.1" in first


def test_tail_follows_a_run_started_after_it_and_exits_when_it_ends(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    follow_from_before_the_run(tmp_path / "live.db", procs)


def test_tail_prints_the_last_stored_steps_then_the_new_ones(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    db, go = tmp_path / "live.db", tmp_path / "go"
    writer = writer_proc(db, "paused", "--go-file", str(go))
    procs.append(writer)
    said = Lines(writer.stdout)
    run_id = said.wait_for(r"^[0-9a-f]{32}$")
    said.wait_for("^paused$")  # epoch 0 (steps 0..11) is stored; the writer waits for the go file
    with batchtap.store.open(db) as st:
        assert st.run(run_id).last_step == 11
    tail = tail_proc(db, run_id[:12], "-n", "3")
    procs.append(tail)
    out = Lines(tail.stdout)
    out.wait_for(r"^step=11 ")
    go.touch()  # only now are steps 12..35 written
    assert writer.wait(timeout=TIMEOUT) == 0
    lines = out.rest()
    assert tail.wait(timeout=TIMEOUT) == 0
    assert _steps(lines) == list(range(9, 36)), lines
    assert "finished at step 35" in lines[-1]


def test_tail_of_an_ended_run_prints_its_last_steps_and_exits(runs: Runs) -> None:
    done = cli("tail", "cli-stop", "--db", str(runs.db), "-n", "4", "-m", "loss")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert _steps(lines) == [17, 18, 19, 20]
    assert lines[1] == lines[1].split(" loss=")[0] + " loss=" + lines[1].split(" loss=")[1]  # loss is the one column
    assert all(line.count("=") == 4 for line in lines if STEP.match(line))
    assert lines[-1].startswith("# run cli-stop") and "stopped at step 20" in lines[-1]


def test_tail_on_a_terminal_draws_a_live_table(runs: Runs) -> None:
    master, slave = pty.openpty()
    proc = popen(
        [sys.executable, "-m", "batchtap.cli.main", "tail", "cli-base", "--db", str(runs.db), "-n", "5"],
        stdout=slave,
        stderr=subprocess.PIPE,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the other side closed
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=TIMEOUT) == 0
    os.close(master)
    screen = b"".join(chunks).decode()
    assert "\x1b[K" in screen  # drawn in place, not as plain lines
    assert re.search(r"step\s+epoch\s+batch\s+loss\s+accuracy", screen)
    assert "anomalies 2" in screen and "finished at step 35" in screen
    assert "step=" not in screen


def test_tail_exits_1_when_the_writer_died_and_the_run_never_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    db = tmp_path / "orphan.db"
    sink = SQLite(db)
    sink.start_run(
        RunInfo("0rphan", "orphan", {}, started_at=1.0, environment={"host": socket.gethostname(), "pid": dead.pid})
    )
    sink.close()
    assert main(["tail", "orphan", "--db", str(db), "--stale", "0", "--interval", "0.05"]) == 1
    assert "its process" in capsys.readouterr().err


def test_tail_without_wait_exits_1_for_an_unknown_run(runs: Runs) -> None:
    done = cli("tail", "not-yet", "--db", str(runs.db))
    assert done.returncode == 1 and "no run 'not-yet'" in done.stderr
