"""CudaClock's own logic on the CPU: which event each mark records, ms -> s, and queries that never wait.

Real CUDA events need a driver; the GPU run (tests/test_tap_gpu.py) times real steps with them. Here
``torch.cuda.Event`` and the stream calls are replaced by a stand-in with CUDA's documented
behaviour where it matters to the clock: ``elapsed_time`` refuses events made without
``enable_timing=True`` or never recorded, ``query()`` is true once the device "reached" the event,
and an event records the stream's position at ``record()``. The stand-in device advances only
when the test says so, so every value is exact.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from batchtap.capture.clock import CudaClock


class StandInDevice:
    """A device timeline: ``now_ms`` of device time, and how far the device has executed."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.queued = 0  # work items queued on the stream so far
        self.executed = 0  # work items the device finished


class StandInEvent:
    device: StandInDevice

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.position: int | None = None
        self.time_ms: float | None = None

    def record(self, stream: object = None) -> None:
        self.device.queued += 1
        self.position = self.device.queued
        self.time_ms = self.device.now_ms

    def query(self) -> bool:
        return self.position is None or self.position <= self.device.executed

    def elapsed_time(self, end: StandInEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self.time_ms is None or end.time_ms is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return end.time_ms - self.time_ms


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> StandInDevice:
    dev = StandInDevice()
    event_type = type("Event", (StandInEvent,), {"device": dev})
    monkeypatch.setattr(torch.cuda, "Event", event_type)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return dev


def _clock() -> CudaClock:
    return CudaClock(3, torch.device("cuda", 0))


def test_step_time_is_the_device_time_between_the_slots_marks_in_seconds(device: StandInDevice) -> None:
    clock = _clock()
    for slot, ms in enumerate([250.0, 500.0, 125.0]):
        clock.mark_start(slot)
        device.now_ms += ms
        clock.mark_end(slot)
        device.now_ms += 1000.0  # between steps (a flush, the data wait): not part of any step
    device.executed = device.queued
    assert [clock.end_done(s) for s in range(3)] == [True, True, True]
    assert [clock.elapsed(s) for s in range(3)] == [0.25, 0.5, 0.125]


def test_end_done_and_markers_follow_the_device_without_waiting(device: StandInDevice) -> None:
    clock = _clock()
    clock.mark_start(0)
    clock.mark_end(0)
    marker = clock.block_marker()
    assert not clock.end_done(0) and not clock.marker_done(marker)  # the device is behind
    device.executed = device.queued - 1  # reached the end mark, not the block's copy after it
    assert clock.end_done(0) and not clock.marker_done(marker)
    device.executed = device.queued
    assert clock.marker_done(marker)


def test_a_slot_without_a_start_mark_has_no_time_and_disarm_forgets_it(device: StandInDevice) -> None:
    clock = _clock()
    clock.mark_end(1)  # the run's first step: the ring did not exist at its start
    device.executed = device.queued
    assert math.isnan(clock.elapsed(1))
    clock.mark_start(2)
    device.now_ms += 8.0
    clock.mark_end(2)
    device.executed = device.queued
    assert clock.elapsed(2) == 0.008
    clock.disarm(2)
    assert math.isnan(clock.elapsed(2))


def test_marks_are_reused_per_slot_not_made_per_step(device: StandInDevice) -> None:
    clock = _clock()
    starts, ends = list(clock._start), list(clock._end)
    for step in range(7):
        slot = step % 3
        clock.mark_start(slot)
        device.now_ms += 2.0
        clock.mark_end(slot)
    assert clock._start == starts and clock._end == ends  # the same event objects, recorded again
    assert len({id(e) for e in starts + ends}) == 6
