"""Nothing lost: SIGTERM, SIGKILL mid-write, resume, slow and failing sinks, through a real Tap."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import batchtap as bt
from batchtap import store
from tests.conftest import ListSink

ROOT = Path(__file__).resolve().parents[1]


def _start(db: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.durability_worker", str(db), *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _read_until_step(proc: subprocess.Popen[str], step: int) -> tuple[str, int]:
    run_id, last = "", -1
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("run "):
            run_id = line.split()[1]
        elif line.startswith("step "):
            last = int(line.split()[1])
            if last >= step:
                break
    return run_id, last


def _stored_steps(db: Path, run_id: str) -> list[int]:
    with sqlite3.connect(db) as conn:
        return [
            s
            for (s,) in conn.execute(
                "SELECT DISTINCT step FROM metrics WHERE run_id = ? AND metric = 'loss' ORDER BY step", (run_id,)
            )
        ]


def test_sigterm_stores_every_captured_step_and_marks_the_run_stopped(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    proc = _start(db)
    run_id, printed = _read_until_step(proc, random.Random(7).randint(12, 60))
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM, err  # it ends as SIGTERM ends a process
    last_printed = max([printed] + [int(x.split()[1]) for x in rest.splitlines() if x.startswith("step ")])
    steps = _stored_steps(db, run_id)
    assert steps == list(range(len(steps))) and steps[-1] >= last_printed
    with store.open(db) as s:
        row = s.run(run_id)
    assert row.status is bt.RunStatus.STOPPED and row.stop_reason == "SIGTERM"


def test_sigkill_mid_write_leaves_a_consistent_db_and_resume_continues(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    proc = _start(db)
    run_id, _ = _read_until_step(proc, 200)
    proc.kill()
    proc.communicate(timeout=30)
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    before = _stored_steps(db, run_id)
    assert before == list(range(len(before))) and len(before) >= 150
    resumed = _start(db, run_id)
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    after = _stored_steps(db, run_id)
    assert after == list(range(len(after))) and len(after) == len(before) + 41  # no gap, no duplicate
    with sqlite3.connect(db) as conn:
        dupes = conn.execute(
            "SELECT COUNT(*) FROM (SELECT run_id, metric, step, rank, COUNT(*) c FROM metrics "
            "GROUP BY run_id, metric, step, rank HAVING c > 1)"
        ).fetchone()[0]
        assert dupes == 0
    with store.open(db) as s:
        assert s.run(run_id).status is bt.RunStatus.FINISHED


class StuckSink(ListSink):
    """Its first write does not return until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, records, events=()):
        self.entered.set()
        self.gate.wait()
        super().write(records, events)


def test_a_sink_stuck_in_write_does_not_hold_up_steps() -> None:
    # The sink's first write hangs for the whole loop: 250 steps, a flush every 5 -- 50 blocks, within
    # the sink queue's 64 -- must still all be taken, because the pipeline hands blocks to the sink's
    # own worker and never waits for the sink. The loop runs in a thread so that a regression shows
    # as a failed wait instead of a hung suite. (Past the queue's size, "block" applies backpressure
    # and "drop_oldest" drops, as tests/pipeline/test_dispatch.py shows.)
    sink = StuckSink()
    tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=5, queue_size=64)
    looped = threading.Event()

    def loop() -> None:
        for i in range(250):
            tap.step(loss=torch.tensor(float(i)))
        looped.set()

    with tap, tap.run():
        trainer = threading.Thread(target=loop)
        trainer.start()
        try:
            assert looped.wait(120), "the training loop waited for a stuck sink"
            assert sink.entered.is_set() and sink.writes == 0  # the sink really was stuck all along
            assert tap._pipeline.drain(60)  # every block handed to the sink's queue
        finally:
            sink.gate.set()
            trainer.join(60)
    assert [r.step for r in sink.records] == list(range(250))
    assert sink.writes == 2  # the stuck call, then everything queued meanwhile in one call


class OutageSink(ListSink):
    """Raises for the first ``seconds`` of its life, then works."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.until = time.monotonic() + seconds

    def write(self, records, events=()):
        if time.monotonic() < self.until:
            raise ConnectionError("server gone")
        super().write(records, events)


def test_a_sink_down_for_3_seconds_loses_nothing_with_a_spool(tmp_path: Path) -> None:
    down, other = OutageSink(3.0), ListSink()
    tap = bt.Tap([bt.metrics.Loss()], [down, other], flush_every=10, spool_dir=tmp_path / "spool")
    with tap, tap.run():
        for i in range(400):
            tap.step(loss=torch.tensor(float(i)))
            time.sleep(0.01)  # ~4 s of training: the outage starts and ends inside the run
    assert [r.step for r in down.records] == list(range(400))
    assert [r.step for r in other.records] == list(range(400))
    warnings = [e.message for e in other.events if e.kind is bt.EventKind.WARNING]
    assert any("server gone" in m for m in warnings)


def test_resume_without_a_store_is_a_clear_error() -> None:
    with bt.Tap(sinks=[ListSink()]) as tap:
        try:
            with tap.run(resume="abc"):
                pass
        except bt.ConfigError as exc:
            assert "cannot resume run 'abc'" in str(exc) and "bt.sinks.SQLite" in str(exc)
        else:
            raise AssertionError("expected ConfigError")


def test_sigterm_handler_is_restored_after_the_run() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with bt.Tap(sinks=[]) as tap, tap.run():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    assert threading.current_thread() is threading.main_thread()
