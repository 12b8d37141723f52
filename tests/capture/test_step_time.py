"""Step time against a known in-step duration: the step's own work, not the data wait, not a flush.

Two kinds of test. With a controllable clock (the host clock's ``time`` replaced by one the test
advances) the expected value is exact: the test says how long the data wait, the step's work and
each flush "took", and step time must be the work alone. With the real clock and a real sleep
inside the step, step time is at least the sleep (a lower bound holds on any machine, however
loaded; an upper bound would be a wall-clock assertion and is left to the controllable clock).
"""

from __future__ import annotations

import math
import time
import types

import pytest
import torch

import batchtap as bt
import batchtap.capture.clock as clock_module
import batchtap.capture.loader as loader_module
from tests.conftest import ListSink

WORK = 0.25  # seconds of "work" inside every step (binary-exact, so differences are exact)
DATA_WAIT = 2.0  # each batch takes this long to arrive
FLUSH = 8.0  # each flush "costs" this much on the training thread


class ManualClock:
    """``time.perf_counter`` that moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def manual(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    clock = ManualClock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(clock_module, "time", fake_time)  # step marks (HostClock)
    monkeypatch.setattr(loader_module, "time", fake_time)  # the data wait around the loader
    return clock


def _costly_flush(clock: ManualClock) -> bt.metrics.StepTime:
    class StepTimeWithCostlyFlush(bt.metrics.StepTime):
        def on_flush(self) -> None:  # runs on the training thread inside every flush
            clock.advance(FLUSH)

    return StepTimeWithCostlyFlush()


def test_step_time_is_the_work_between_steps_excluding_the_flush(manual: ManualClock) -> None:
    sink = ListSink()
    with bt.Tap([bt.metrics.Loss(), _costly_flush(manual)], [sink], flush_every=2) as tap, tap.run():
        for i in range(7):
            manual.advance(WORK)
            tap.step(loss=torch.tensor(float(i)))
    assert [r.step for r in sink.records] == list(range(7))
    assert "step_time" not in sink.records[0].values  # the first step has no measured start
    # steps 2, 4 and 6 follow a flush: FLUSH seconds passed before their start mark, not inside them
    assert [r.values["step_time"] for r in sink.records[1:]] == [WORK] * 6


def test_watched_step_time_excludes_the_data_wait_and_the_flush(manual: ManualClock) -> None:
    def loader():
        for i in range(7):
            manual.advance(DATA_WAIT)
            yield torch.tensor(float(i))

    sink = ListSink()
    metrics = [bt.metrics.Loss(), _costly_flush(manual), bt.metrics.DataTime()]
    with bt.Tap(metrics, [sink], flush_every=2) as tap, tap.run():
        for loss in tap.watch(loader()):
            manual.advance(WORK)
            tap.step(loss=loss)
    assert [r.step for r in sink.records] == list(range(7))
    assert "step_time" not in sink.records[0].values  # the ring is made at the first step: no start mark
    assert [r.values["step_time"] for r in sink.records[1:]] == [WORK] * 6  # from the batch's arrival
    assert [r.values["data_time"] for r in sink.records] == [DATA_WAIT] * 7


def test_step_time_measures_a_real_sleep_inside_the_step() -> None:
    sleep = 0.03
    sink = ListSink()

    def loader():
        for i in range(4):
            yield torch.tensor(float(i))

    with bt.Tap([bt.metrics.Loss(), bt.metrics.StepTime()], [sink], flush_every=1) as tap, tap.run():
        for loss in tap.watch(loader()):
            time.sleep(sleep)
            tap.step(loss=loss)
    times = [r.values["step_time"] for r in sink.records[1:]]
    assert len(times) == 3 and all(math.isfinite(t) for t in times)
    assert min(times) >= sleep  # at least the work; sleep() never returns early
