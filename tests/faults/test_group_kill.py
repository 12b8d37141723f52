"""Issue 29 item 6: a process-group SIGKILL (how SLURM, Kubernetes and the OOM killer end a job:
the training process, its pipeline process and Python's resource tracker together) leaves no
shared-memory segment behind once a later batchtap process runs, and the run reads ``killed``; a
SIGKILL of the training process alone prints no "leaked shared_memory objects" warning.

Real processes: a training script in a session of its own (``setsid``), killed with ``os.killpg``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import batchtap as bt
import batchtap.store
from batchtap import _stale
from tests.faults._procs import env

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shared memory in /dev/shm")

WORKER = """
import sys, time, torch, batchtap as bt
tap = bt.Tap([bt.metrics.Loss()], [bt.sinks.SQLite(sys.argv[1])], pipeline="process", flush_every=2)
with tap, tap.run(name="victim") as run:
    for step in range(6):
        tap.step(loss=torch.tensor(float(step)))
    tap.flush()
    print(f"ready {run.id}", flush=True)
    time.sleep(600)
"""


def _segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"bt{pid}_"))


def _start(db: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        start_new_session=True,  # setsid: its own process group, as a batch system starts a job
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise AssertionError(f"the worker did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc, line.split()[1]


def _wait_gone(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process group {pid} still alive after {timeout} s")


def test_a_process_group_kill_leaves_no_segment_once_a_new_tap_runs_and_the_run_reads_killed(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    proc, run_id = _start(db)
    segments = _segments_of(proc.pid)
    assert segments, "the process pipeline made its segment, named after its owner"
    os.killpg(proc.pid, signal.SIGKILL)  # the training process, its pipeline process, the resource tracker
    proc.wait(30)
    _wait_gone(proc.pid)
    # nobody of the killed group was left to remove its segment; it is abandoned by our rule (another
    # batchtap process on this host, whose first Tap sweeps, may remove it meanwhile, as designed)
    left = _segments_of(proc.pid)
    assert set(left) <= set(segments)
    assert all(_stale.segment_abandoned(name) for name in left), left
    with batchtap.store.open(db) as st:
        run = st.run(run_id)
    assert run.status is bt.RunStatus.KILLED  # a later batchtap process on this host sees the owner gone
    assert f"pid {proc.pid}" in (run.stop_reason or "") and run.steps >= 4
    # the next batchtap process on the host removes the dead owner's segment when it makes a Tap
    _stale._swept = False  # this test process made Taps before: let its next one sweep again
    tap = bt.Tap([bt.metrics.Loss()], [], flush_every=2)
    assert _segments_of(proc.pid) == []
    with tap, tap.run(name="next"):
        for step in range(4):
            tap.step(loss=torch_scalar(step))
        tap.flush()
    assert _segments_of(os.getpid()) == []


def test_killing_the_training_process_alone_prints_no_leak_warning_and_leaves_no_segment(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    proc, run_id = _start(db)
    assert _segments_of(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the training process only: its pipeline process drains and ends the run
    proc.wait(30)
    _wait_gone(proc.pid)  # the pipeline process and the resource tracker exit too
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    assert "leaked shared_memory" not in stderr, stderr
    assert "resource_tracker" not in stderr, stderr
    assert _segments_of(proc.pid) == [], "the pipeline process removed the dead owner's segment by our rule"
    with batchtap.store.open(db) as st:
        run = st.run(run_id)
    assert run.status is bt.RunStatus.KILLED and run.steps == 6


def torch_scalar(value: float):  # type: ignore[no-untyped-def]
    import torch

    return torch.tensor(float(value))


def test_a_dead_owner_is_told_from_a_live_one_and_a_reused_pid() -> None:
    import socket

    from batchtap import _stale

    me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": _stale.process_started()}
    assert not _stale.owner_gone(me)
    parent = {"host": me["host"], "pid": os.getppid(), "pid_started": _stale.process_started(os.getppid())}
    assert not _stale.owner_gone(parent)
    reused = dict(parent, pid_started=f"{me['pid_started']}-another-process")
    assert _stale.owner_gone(reused)  # that pid now belongs to a process started at another time
    assert not _stale.owner_gone(dict(reused, host="another-host"))  # cannot be told from here
    assert not _stale.owner_gone({"host": me["host"], "pid": os.getppid()})  # alive, no start time: unknown
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert _stale.owner_gone({"host": me["host"], "pid": child.pid})  # reaped: no such process
    assert not _stale.segment_owner_gone("psm_1234")  # not batchtap's: never touched
    assert _stale.segment_owner_gone(f"bt{child.pid}_{child.pid}_1_00ff")
    # an owner gone while its process group lives on (its orphaned pipeline process may still have
    # to attach to the segment) is no abandoned segment; an empty group is
    assert not _stale.segment_abandoned(f"bt{child.pid}_{os.getpgid(0)}_1_00ff")
    assert _stale.segment_abandoned(f"bt{child.pid}_{child.pid}_1_00ff")


EARLY = """
import sys, time, torch, batchtap as bt
db, every, flushes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tap = bt.Tap([bt.metrics.Loss()], [bt.sinks.SQLite(db)], pipeline="process", flush_every=every, flush_seconds=1.0)
with tap, tap.run(name="early") as run:
    for step in range(every * flushes):
        tap.step(loss=torch.tensor(float(step)))
    # rows flushed so far (the count flushes made inside step(); a time flush could move the last one)
    print(f"flushed {run.id} {tap._run.capture.flusher.flushed}", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("flushes", [1, 3])
def test_a_group_kill_right_after_the_first_flushes_loses_nothing_flushed_flush_seconds_before(
    tmp_path: Path, flushes: int
) -> None:
    """Issue 38 item 11: the process pipeline killed with its whole process group (training process,
    pipeline process, resource tracker) within the first seconds of a run. The documented bound
    (docs/storage.md): the steps of every flush made ``flush_seconds`` (here 1 s) before the kill
    are stored; only later ones may be lost. The kill comes exactly that long after the Nth flush,
    the first one included (it once took 4 s for the first row to land)."""
    db = tmp_path / "bt.db"
    every = 5
    proc = subprocess.Popen(
        [sys.executable, "-c", EARLY, str(db), str(every), str(flushes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        start_new_session=True,  # setsid: its own process group, as a batch system starts a job
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # generous: the read waits as long as the start takes
        flushed_at = time.monotonic()
        if not line.startswith("flushed "):
            raise AssertionError(f"the worker did not run: {line!r} {proc.stderr.read() if proc.stderr else ''}")
        _, run_id, flushed = line.split()
        assert int(flushed) == every * flushes  # count flushes only: each completed flush is known
        time.sleep(max(0.0, flushed_at + 1.0 - time.monotonic()))  # the bound: flush_seconds after the flush
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the training process, its pipeline process, the resource tracker
        proc.wait(30)
    _wait_gone(proc.pid)
    with batchtap.store.open(db) as st:
        run = st.run(run_id)
        points = st.series(run_id, "loss")
    assert [p.step for p in points] == list(range(every * flushes)), points  # every flushed step, once
    assert [p.value for p in points] == [float(p.step) for p in points]
    assert run.status is bt.RunStatus.KILLED
