"""Both pipeline hosts on their own, fed messages built directly from BlockData (no ring, no Tap)."""

from __future__ import annotations

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
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.core import PipelineSettings
from batchtap.pipeline.chain.messages import BlockRows, RunStart
from batchtap.pipeline.transport.crossing import dumps_to_child
from batchtap.pipeline.transport.host import PipelineHost
from batchtap.pipeline.transport.make import make_pipeline
from batchtap.pipeline.transport.process import ProcessPipeline
from batchtap.pipeline.transport.thread import ThreadPipeline
from batchtap.records import Event, EventKind, RunInfo, RunStatus
from tests.pipeline._blocks import loss_block, metrics
from tests.pipeline.probe_sinks import ModulesSink, notes
from tests.pipeline.process_sinks import FileListSink, received
from tests.pipeline.test_distributed import ROOT


def _open(host: PipelineHost, run: RunInfo) -> int:
    host.start_run(run)
    return host.open_chain(Layout(list(metrics())), run_id=run.id, rank=0, writes=True, reduce=None, max_rows=8)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_host_hands_every_message_to_its_core_in_order(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "sink.pkl"
    control = Control()
    host = make_pipeline(kind, [FileListSink(path)], control, PipelineSettings())  # type: ignore[arg-type]
    run = RunInfo("r", "hosts", {}, 0.0)
    try:
        chain = _open(host, run)
        host.send(BlockRows(chain, loss_block([0.5, math.nan])))
        host.events([Event("r", 1, EventKind.WARNING, "from the training side", 0.0)], chain)
        host.start_epoch("r", 1, 4)
        host.send(BlockRows(chain, loss_block([0.25], first_step=2)))
        assert host.drain(30)
        assert control.anomaly_counts == {"loss": 1}  # from the core, wherever it runs
        ended = RunInfo("r", "hosts", {}, 0.0, status=RunStatus.FINISHED)
        host.end_run(ended)
        assert host.finish_run(ended, timeout=30, last_step=2)
        assert host.stored_position("r") == ([], [])
    finally:
        host.close(timeout=30)
    sink, pids = received(path)
    assert [r.step for r in sink.records] == [0, 1, 2]
    assert [e.message for e in sink.events if e.kind is EventKind.WARNING] == ["from the training side"]
    assert [e.step for e in sink.events if e.kind is EventKind.ANOMALY] == [1]  # the NaN loss
    assert [r.id for r in sink.started] == ["r"] and [r.status for r in sink.ended] == [RunStatus.FINISHED]
    assert sink.closed
    assert (os.getpid() in pids) == (kind == "thread")


def _kill(host: ProcessPipeline) -> int:
    proc = host.link.process
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    return proc.pid


def test_the_process_host_delegates_to_a_thread_after_the_second_death(tmp_path: Path) -> None:
    path = tmp_path / "sink.pkl"
    host = ProcessPipeline([FileListSink(path)], Control())
    run = RunInfo("r", "failover", {}, 0.0)
    try:
        chain = _open(host, run)
        host.send(BlockRows(chain, loss_block([0.0, 1.0])))
        first = _kill(host)
        deadline = time.monotonic() + 30
        while host.link.process.pid == first and time.monotonic() < deadline:
            time.sleep(0.01)  # the receiver thread restarts it
        assert host.current is host.link
        host.send(BlockRows(chain, loss_block([2.0], first_step=2)))
        _kill(host)
        while host.current is host.link and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(host.current, ThreadPipeline)
        host.send(BlockRows(chain, loss_block([3.0], first_step=3)))  # straight to the thread
        assert host.drain(30)
    finally:
        host.close(timeout=30)
    sink, pids = received(path)
    assert sorted({r.step for r in sink.records}) == [0, 1, 2, 3]  # nothing lost (a resent block may repeat)
    assert os.getpid() in pids and sink.closed
    reports = [e.message for e in sink.events if e.kind is EventKind.WARNING]
    assert any("restarted" in m for m in reports) and any("went on in a thread" in m for m in reports)


def test_the_pipeline_process_needs_no_torch_for_a_runs_start() -> None:
    """Its own modules, its sinks and a run's start (whose environment holds torch's version
    string) load no torch: only a chain's metrics need it (a thread loads it beside the main loop)."""
    run = RunInfo("r", "light", {}, 0.0, environment={"torch": torch.__version__})
    payload = dumps_to_child(RunStart(run), {})
    code = (
        "import sys\n"
        "from batchtap.pipeline.transport import child, crossing\n"
        "from batchtap.pipeline.chain.messages import RunStart\n"
        "from tests.pipeline.probe_sinks import ModulesSink\n"
        f"message = crossing.loads_from_parent({payload!r})\n"
        "assert isinstance(message, RunStart) and type(message.run.environment['torch']) is str\n"
        "assert 'torch' not in sys.modules, 'the pipeline process loaded torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_a_thread_host_is_closed_once(tmp_path: Path) -> None:
    host = ThreadPipeline([FileListSink(tmp_path / "s.pkl")], Control())
    host.close(timeout=10)
    host.close(timeout=10)
    sink, _ = received(tmp_path / "s.pkl")
    assert sink.closed


def test_a_whole_process_pipeline_run_never_loads_torch_in_the_pipeline_process(tmp_path: Path) -> None:
    """Blocks cross as arrays with the run's torch-free column layout, and the default metrics
    (with an lr and a gradient norm) decode in numpy: the pipeline process never loads torch, so it starts
    and ends without paying for it."""

    path = tmp_path / "modules.jsonl"
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tap = bt.Tap(sinks=[ModulesSink(path)], optimizer=optimizer, model=model, flush_every=4, pipeline="process")
    with tap.run(name="torch-free"):
        for _ in range(10):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tap.step(loss=loss, outputs=out, targets=y)
    tap.close()
    seen = notes(path)
    assert {n["call"] for n in seen} >= {"start_run", "write", "end_run"}
    assert all(n["pid"] != os.getpid() for n in seen), "the sink ran in the training process"
    assert not any(n["torch"] for n in seen), f"the pipeline process loaded torch: {seen}"
