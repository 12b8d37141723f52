"""``Tap(pipeline="process")``: the same records as the thread pipeline, from a process of its own,
and nothing lost or left behind however either process ends."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.errors import ConfigError
from batchtap.records import EventKind, RunStatus
from tests.conftest import ListSink
from tests.pipeline import process_worker
from tests.pipeline.process_sinks import FileListSink, received

ROOT = Path(__file__).resolve().parents[2]
#: values that measure time differ between two runs; everything else must be equal
TIMED = {"step_time", "data_time", "throughput"}


def _train(tap: bt.Tap, steps: int = 60, nan_at: int | None = None) -> int:
    """A small deterministic loop; returns the step at which should_stop turned True (or -1)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tap.run(name="same"):
        for step in range(steps):
            x, y = torch.randn(16, 6), torch.randint(0, 4, (16,))
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            if step == nan_at:
                loss = loss * math.nan
            opt.zero_grad()
            loss.backward()
            opt.step()
            tap.step(loss=loss, outputs=out, targets=y, extra={"half_loss": loss.detach() / 2})
            if step % 10 == 9:
                tap.log({"eval_score": step / 100})
            if tap.should_stop:
                return step
    return -1


def _untimed(sink: ListSink) -> list[tuple[int, bool, dict[str, float]]]:
    return [
        (r.step, r.sparse, {k: v for k, v in r.values.items() if k not in TIMED})
        for r in sorted(sink.records, key=lambda r: (r.step, r.sparse))
    ]


def _same(a: list, b: list) -> bool:
    """Equal, NaN equal to NaN."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize("nan_at", [None, 37], ids=["clean", "nan_stops"])
def test_the_process_pipeline_stores_what_the_thread_pipeline_stores(tmp_path: Path, nan_at: int | None) -> None:
    rules = [bt.rules.NonFinite("loss")]
    thread_sink = ListSink()
    with bt.Tap(sinks=[thread_sink], flush_every=8, rules=rules) as tap:
        thread_stop = _train(tap, nan_at=nan_at)
        thread_counts, thread_reason = tap.anomaly_counts, tap.stop_reason
    with bt.Tap(sinks=[FileListSink(tmp_path / "p.pkl")], flush_every=8, rules=rules, pipeline="process") as tap:
        process_stop = _train(tap, nan_at=nan_at)
        process_counts, process_reason = tap.anomaly_counts, tap.stop_reason
    process_sink, pids = received(tmp_path / "p.pkl")
    assert pids and os.getpid() not in pids  # the sink ran in the pipeline process
    assert len(process_sink.records) == len(thread_sink.records) > 0
    assert _same(_untimed(process_sink), _untimed(thread_sink))
    assert [(e.kind, e.step, e.message) for e in process_sink.events] == [
        (e.kind, e.step, e.message) for e in thread_sink.events
    ]
    assert (process_stop, process_reason, process_counts) == (thread_stop, thread_reason, thread_counts)
    assert [r.status for r in process_sink.ended] == [r.status for r in thread_sink.ended]
    if nan_at is not None:
        assert process_stop == nan_at and process_sink.ended[0].status is RunStatus.STOPPED


def _launch(how: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "tests.pipeline.process_worker", how, str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_sigkill_of_the_training_process_loses_no_flushed_block(tmp_path: Path) -> None:
    done = _launch("sigkill", tmp_path)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert _gone(pids["pipeline"]), "the pipeline process outlived its training process"
    sink, _ = received(tmp_path / "sink.pkl")
    steps = sorted(r.step for r in sink.records)
    assert steps == list(range(process_worker.KILL_AFTER))  # every flushed row, once
    assert all(math.isfinite(r.values["loss"]) for r in sink.records)
    assert len(sink.ended) == 1 and sink.ended[0].status is RunStatus.KILLED
    assert "killed or crashed" in (sink.ended[0].stop_reason or "")


@pytest.mark.parametrize(
    ("how", "status", "returncode"),
    [
        ("close", RunStatus.FINISHED, 0),
        ("no_close", RunStatus.FINISHED, 0),
        ("raise", RunStatus.FAILED, 1),
        ("exit_open", RunStatus.FAILED, 0),
        ("sigterm", RunStatus.STOPPED, -signal.SIGTERM),
    ],
)
def test_no_pipeline_process_outlives_any_exit(tmp_path: Path, how: str, status: RunStatus, returncode: int) -> None:
    done = _launch(how, tmp_path)
    assert done.returncode == returncode, done.stderr
    pids = json.loads((tmp_path / "pids.json").read_text())
    assert _gone(pids["pipeline"]), f"{how}: the pipeline process was left behind"
    sink, _ = received(tmp_path / "sink.pkl")
    expected = process_worker.STEPS if how in ("close", "no_close") else process_worker.KILL_AFTER
    assert sorted(r.step for r in sink.records) == list(range(expected))
    assert [r.status for r in sink.ended] == [status]


def _kill_pipeline(tap: bt.Tap) -> None:
    proc = tap._pipeline.link.process  # type: ignore[attr-defined]
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already reaped (a restart racing this call): it is gone either way
        pass
    proc.join(10)


def test_a_dead_pipeline_process_is_restarted_once_then_replaced_by_a_thread(tmp_path: Path) -> None:
    path = tmp_path / "p.pkl"
    torch.manual_seed(0)
    with bt.Tap(sinks=[FileListSink(path)], flush_every=4, flush_seconds=3600, pipeline="process") as tap:
        first = tap._pipeline.link.process.pid  # type: ignore[attr-defined]
        with tap.run(name="crashes"):
            for step in range(90):
                tap.step(loss=torch.tensor(float(step)))
                if step in (29, 58, 59):
                    tap.log({"val": torch.tensor(step / 100)})  # travels with the block the kill hits
                if step in (29, 59):
                    _kill_pipeline(tap)
        second = tap._pipeline.link.process.pid  # type: ignore[attr-defined]
    sink, pids = received(path)
    assert second != first and {first, second, os.getpid()} >= pids  # restarted once, then the thread
    assert os.getpid() in pids
    steps = [r for r in sink.records if not r.sparse]
    assert sorted({r.step for r in steps}) == list(range(90))  # nothing lost (a resent block may repeat)
    assert all(r.values["loss"] == r.step for r in steps)
    logged = {(r.step, round(r.values["val"], 6)) for r in sink.records if r.sparse}  # (resent ones may repeat)
    assert logged == {(29, 0.29), (58, 0.58), (59, 0.59)}
    reports = [e.message for e in sink.events if e.kind is EventKind.WARNING]
    assert any("restarted" in m for m in reports) and any("in a thread" in m for m in reports)
    assert [r.status for r in sink.ended][-1] is RunStatus.FINISHED


class _Unpicklable(bt.sinks.Sink):
    def __init__(self) -> None:
        self.hook = lambda records: None

    def write(self, records, events=()):  # type: ignore[no-untyped-def]
        pass


def test_a_sink_that_cannot_travel_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="pipeline='thread'"):
        bt.Tap(sinks=[_Unpicklable()], pipeline="process")


def test_an_unknown_pipeline_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="'thread' or 'process'"):
        bt.Tap(sinks=[], pipeline="fiber")  # type: ignore[arg-type]


def test_a_rule_that_reads_training_side_objects_is_refused_with_the_fix() -> None:
    sampler = bt.AdaptiveBatchSampler(list(range(64)), batch_size=8)
    rule = bt.BatchSizeRule(sampler, metric="loss", grow_above=10.0)
    with pytest.raises(ConfigError, match=r"batch.*pipeline='thread'"):
        bt.Tap(sinks=[], rules=[rule], pipeline="process")
    bt.Tap(sinks=[], rules=[rule], pipeline="thread").close()  # the thread pipeline takes it


def test_steps_and_logs_inside_paused_do_not_wait_for_themselves(tmp_path: Path) -> None:
    # The process pipeline hands a CPU block over on the training thread: inside tap.paused() it
    # must defer to its forwarder rather than wait for a resume only this thread can make.
    path = tmp_path / "p.pkl"
    with bt.Tap(sinks=[FileListSink(path)], flush_every=2, flush_seconds=3600, pipeline="process") as tap:
        with tap.run(name="paused"):
            tap.step(loss=torch.tensor(1.0))
            with tap.paused():
                for step in range(1, 6):
                    tap.step(loss=torch.tensor(float(step)))
                tap.request_stop("asked inside paused()")
            tap.step(loss=torch.tensor(6.0))
    sink, _ = received(path)
    assert sorted(r.step for r in sink.records) == list(range(7))
    assert any("asked inside paused()" in e.message for e in sink.events)
