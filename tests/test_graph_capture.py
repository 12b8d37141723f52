"""CUDA graphs: tap.paused() keeps the pipeline thread's device queries out of a capture, and a
step called during a capture is refused with a clear error (the capture itself is simulated on
this CPU machine: FakeTensorMode for the CUDA path, torch.cuda.is_current_stream_capturing forced
on; bench/gpu_check.sh runs the real capture on a GPU)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import batchtap as bt
import batchtap.capture.ring as ring_module
import batchtap.capture.session as session_module
from batchtap.capture.clock import DeviceGate, HostClock
from tests.conftest import ListSink


def test_pause_waits_for_a_query_in_flight_and_holds_back_new_ones() -> None:
    gate = DeviceGate()
    in_query, release_query, paused, second_query_ran = (threading.Event() for _ in range(4))

    def pipeline() -> None:
        with gate.querying():
            in_query.set()
            release_query.wait()
        paused.wait()
        with gate.querying():
            second_query_ran.set()

    worker = threading.Thread(target=pipeline)
    worker.start()
    in_query.wait()
    pauser = threading.Thread(target=gate.pause)
    pauser.start()
    pauser.join(timeout=0.2)
    assert pauser.is_alive(), "pause() returned while a query was in flight"
    release_query.set()
    pauser.join()
    assert gate.paused
    paused.set()
    assert not second_query_ran.wait(timeout=0.2), "a query started while paused"
    gate.resume()
    assert second_query_ran.wait(timeout=5)
    worker.join()


def test_paused_holds_rows_back_until_it_ends_and_refuses_flush() -> None:
    sink = ListSink()
    with bt.Tap([bt.metrics.Loss()], [sink], flush_every=2, flush_seconds=3600) as tap, tap.run():
        with tap.paused():
            for _ in range(4):  # two blocks flushed while paused: read only after it ends
                tap.step(loss=torch.tensor(1.0))
            with pytest.raises(bt.RunStateError, match=r"flush\(\) was called inside tap.paused\(\)"):
                tap.flush()
            assert sink.records == []
        tap.flush()
        assert [r.step for r in sink.records] == [0, 1, 2, 3]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module, "clock_for", lambda device, capacity: HostClock(capacity))
    monkeypatch.setattr(ring_module, "host_buffer", lambda shape, pin: torch.zeros(shape))


@pytest.mark.parametrize("first_step_captured", [False, True], ids=["later_step", "first_step"])
def test_a_step_during_a_graph_capture_is_refused_and_loses_nothing(
    fake_cuda: None, monkeypatch: pytest.MonkeyPatch, first_step_captured: bool
) -> None:
    sink = ListSink()
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with FakeTensorMode(allow_non_fake_inputs=True):
        tap = bt.Tap([bt.metrics.Loss()], [sink], flush_every=4)
        with tap, tap.run():
            loss = torch.randn(3, device="cuda").mean()
            steps = 0 if first_step_captured else 3
            for _ in range(steps):
                tap.step(loss=loss)
            capturing[0] = True
            with pytest.raises(bt.InputError, match="while a CUDA graph is being captured.*tap.paused"):
                tap.step(loss=loss)
            with pytest.raises(bt.InputError, match="while a CUDA graph is being captured"):
                tap.accumulate(loss=loss)
            capturing[0] = False
            tap.step(loss=loss)  # after the capture: recorded as the next step
    assert [r.step for r in sink.records] == list(range(steps + 1))
