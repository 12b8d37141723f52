"""Step clocks: where a step starts and ends, measured on the device's own timeline.

On CUDA a step boundary is a CUDA event recorded into the current stream, so the elapsed time is
GPU time between the two boundaries, not the time the host spent queueing kernels. Events are
preallocated, one start/end pair per ring slot, and reused when the slot is. On the CPU the
boundaries are host clock readings taken at the same points of the step.

A clock also answers "has the device reached the end of step ``slot`` yet?" without blocking:
the fast NaN channel and the flusher rely on it.
"""

from __future__ import annotations

import abc
import contextlib
import math
import threading
import time
from collections.abc import Iterator, Sequence

import torch

__all__ = ["StepClock", "HostClock", "CudaClock", "DeviceGate", "clock_for"]


class StepClock(abc.ABC):
    """Start/end marks per ring slot, plus completion markers for flushed blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # a start mark exists for the slot's current row (a list: written every step, a numpy
        # element write would cost several times as much)
        self._armed = [False] * capacity

    @abc.abstractmethod
    def mark_start(self, slot: int) -> None:
        """Record the start of the step that will occupy ``slot`` (and arm the slot)."""

    @abc.abstractmethod
    def mark_end(self, slot: int) -> None:
        """Record the end of the step in ``slot`` (after its ring row and guard copy were queued)."""

    def disarm(self, slot: int) -> None:
        """Forget the start mark of ``slot`` (its next step has no measurable start)."""
        self._armed[slot] = False

    def elapsed(self, slot: int) -> float:
        """Seconds between the start and end marks of ``slot``; NaN without a start mark.

        Only valid once :meth:`end_done` is true for the slot.
        """
        return self._elapsed(slot) if self._armed[slot] else math.nan

    def take_elapsed(self, slots: Sequence[int]) -> list[float]:
        """:meth:`elapsed` of each of ``slots`` (a flushed block's), then :meth:`disarm` them: the
        slots' next rows must record start marks of their own."""
        seconds = self._elapsed_of(slots)
        for slot in slots:
            self._armed[slot] = False
        return seconds

    def _elapsed_of(self, slots: Sequence[int]) -> list[float]:
        """:meth:`elapsed` of each of ``slots`` (a clock may read a whole block at once)."""
        return [self.elapsed(slot) for slot in slots]

    @abc.abstractmethod
    def _elapsed(self, slot: int) -> float: ...

    @abc.abstractmethod
    def end_done(self, slot: int) -> bool:
        """Whether the device has executed everything queued before the end mark of ``slot``."""

    @abc.abstractmethod
    def block_marker(self) -> object:
        """Record and return a marker after the work queued so far (a flush's copy)."""

    @abc.abstractmethod
    def marker_done(self, marker: object) -> bool:
        """Whether the device has reached ``marker``. Never blocks."""


class HostClock(StepClock):
    """CPU (and any synchronous device): marks are ``time.perf_counter()`` readings."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._start = [0.0] * capacity
        self._end = [0.0] * capacity

    def mark_start(self, slot: int) -> None:
        self._armed[slot] = True
        self._start[slot] = time.perf_counter()

    def mark_end(self, slot: int) -> None:
        self._end[slot] = time.perf_counter()

    def _elapsed(self, slot: int) -> float:
        return self._end[slot] - self._start[slot]

    def _elapsed_of(self, slots: Sequence[int]) -> list[float]:
        # one comprehension, no call per row (the pipeline reads a block on the training process's GIL)
        armed, start, end, nan = self._armed, self._start, self._end, math.nan
        return [end[slot] - start[slot] if armed[slot] else nan for slot in slots]

    def end_done(self, slot: int) -> bool:
        return True  # work on the CPU is done when the call that queued it returns

    def block_marker(self) -> object:
        return None

    def marker_done(self, marker: object) -> bool:
        return True


class CudaClock(StepClock):
    """CUDA: marks are timing events recorded into the device's current stream."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__(capacity)
        self.device = device
        # The run's stream, looked up once: every step checks that it is still the current one
        # (capture/streams.py), and torch.cuda.current_stream() costs a few us of Python per call.
        self.stream = torch.cuda.current_stream(device)
        with torch.cuda.device(device):
            self._start = [torch.cuda.Event(enable_timing=True) for _ in range(capacity)]
            self._end = [torch.cuda.Event(enable_timing=True) for _ in range(capacity)]

    def mark_start(self, slot: int) -> None:
        self._armed[slot] = True
        self._start[slot].record(self.stream)

    def mark_end(self, slot: int) -> None:
        self._end[slot].record(self.stream)

    def _elapsed(self, slot: int) -> float:
        # Both events completed (the caller checked end_done); elapsed_time then does not wait.
        return self._start[slot].elapsed_time(self._end[slot]) / 1000.0

    def end_done(self, slot: int) -> bool:
        return bool(self._end[slot].query())  # cudaEventQuery: a status poll, not a sync

    def block_marker(self) -> object:
        # One event per flush; flushes are rare (every N steps), so creating one there is cheap.
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def marker_done(self, marker: object) -> bool:
        assert isinstance(marker, torch.cuda.Event)
        return bool(marker.query())


def clock_for(device: torch.device, capacity: int) -> StepClock:
    """The clock that measures steps on ``device``."""
    if device.type == "cuda":
        return CudaClock(capacity, device)
    return HostClock(capacity)


class DeviceGate:
    """Lets the training thread keep batchtap's other threads off the device for a while.

    The pipeline thread queries CUDA events (is a flushed block's copy done? how long did a step
    take?). While the training thread captures a CUDA graph in the default
    ``capture_error_mode="global"``, such a query from another thread invalidates the capture.
    Every query runs inside :meth:`querying`; :meth:`pause` returns only once no query is in
    flight, and none starts until :meth:`resume`.

    Example:
        >>> gate = DeviceGate()
        >>> gate.pause(); gate.paused
        True
        >>> gate.resume(); gate.paused
        False
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._pauses = 0

    @property
    def paused(self) -> bool:
        """Whether queries are held back now."""
        return self._pauses > 0

    @contextlib.contextmanager
    def querying(self) -> Iterator[None]:
        """Run the body (a device query) when not paused; :meth:`pause` waits for it to finish."""
        with self._cv:
            # sync: pipeline thread only — waits while the training thread keeps it off the device.
            self._cv.wait_for(lambda: self._pauses == 0)
            yield

    @contextlib.contextmanager
    def open_now(self) -> Iterator[bool]:
        """Hold the gate for the body without waiting: yields whether queries may run now (False
        while paused). Queries inside the body (:meth:`querying` included) run without waiting,
        and :meth:`pause` waits for the body to end. For callers that must not block, e.g. while
        holding a lock the training thread may need."""
        with self._cv:
            yield self._pauses == 0

    def pause(self) -> None:
        """Hold back device queries from now on (waits for one in flight to finish)."""
        # sync: none with the device — at most the few microseconds of a query in flight.
        with self._cv:
            self._pauses += 1

    def resume(self) -> None:
        """Undo one :meth:`pause`."""
        with self._cv:
            self._pauses = max(self._pauses - 1, 0)
            self._cv.notify_all()
