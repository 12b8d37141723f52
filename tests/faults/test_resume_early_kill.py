"""Issue 15 §8: a run killed (SIGKILL) before its first flush can be resumed, and a resume of a
run no store holds fails without leaving a run behind."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.errors import ConfigError
from tests.faults._procs import env

EARLY = """
import sys, time, torch, batchtap as bt
tap = bt.Tap(sinks=[bt.sinks.SQLite(sys.argv[1])], flush_every=1000, flush_seconds=3600)
with tap.run(name="early") as info:
    for i in range(5):
        tap.step(loss=torch.tensor(float(i)))
    print(info.id, flush=True)
    time.sleep(600)  # killed here, long before the first flush
"""


def test_a_run_killed_before_its_first_flush_resumes_at_step_0(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    proc = subprocess.Popen([sys.executable, "-c", EARLY, str(db)], stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert proc.stdout is not None
        run_id = proc.stdout.readline().strip()
        assert run_id, "the training process did not start"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    with bt.Tap(sinks=[bt.sinks.SQLite(db)]) as tap, tap.run(resume=run_id) as info:
        assert info.id == run_id and info.name == "early"
        for i in range(3):
            tap.step(loss=torch.tensor(10.0 + i))
    with sqlite3.connect(db) as conn:
        runs = conn.execute("SELECT id, name, status FROM runs").fetchall()
        steps = conn.execute("SELECT step, value FROM metrics WHERE metric = 'loss' ORDER BY step").fetchall()
    conn.close()
    assert runs == [(run_id, "early", "finished")]
    assert steps == [(0, 10.0), (1, 11.0), (2, 12.0)]


def test_resuming_an_unknown_run_fails_and_leaves_no_run(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    with bt.Tap(sinks=[bt.sinks.SQLite(db)]) as tap:
        with pytest.raises(ConfigError, match="no sink holds that run"):
            with tap.run(resume="0" * 32):
                pass
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)
    conn.close()
