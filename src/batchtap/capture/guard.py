"""The fast channel: the host sees a step's loss within the device's lag, without a sync.

Each captured step copies its loss into a pinned slot (see :class:`MetricRing`) right after writing
its row, and the step's end mark follows that copy. :meth:`LossGuard.poll` reads the slots whose end
mark the device has passed (a non-blocking query), oldest first. On the CPU the copy is done by the
time ``step()`` returns: where the ring's own loss column is the guard's (``loss_in_place``), each
row is checked when it is tracked, with no queue, so a NaN is seen at the step that produced it.

A host far ahead of the device can come back to a slot before any poll saw the device pass its
previous row; the slot's pinned float and end mark then belong to the new row. So the training
thread calls :meth:`LossGuard.check_before_reuse` for each row before writing it: the row a whole ring earlier
in the same slot was harvested by the pipeline by then (the flusher does not hand out a slot
sooner), so its loss copy is complete and is checked there, before it is overwritten.
"""

from __future__ import annotations

import collections
import math

from batchtap.capture.clock import StepClock
from batchtap.capture.ring import MetricRing

__all__ = ["LossGuard"]


class LossGuard:
    """Polls the per-step loss copies for a non-finite value."""

    def __init__(self, ring: MetricRing, clock: StepClock) -> None:
        self.ring = ring
        self.capacity = ring.capacity  # read at every settle()
        self.clock = clock
        self.in_place = ring.loss_in_place  # a row's loss is readable as soon as it was written
        # (slot, row) of the rows not yet checked, oldest first (empty where the loss is in place)
        self.pending: collections.deque[tuple[int, int]] = collections.deque()
        self._found: tuple[int, float] | None = None  # found before a poll(), reported by the next one

    def track(self, slot: int, row: int) -> None:
        """Watch ``slot``, where the step that was just captured wrote row ``row`` (checked at once
        where the loss is in place)."""
        if not self.in_place:
            self.pending.append((slot, row))
            return
        value = self.ring.guard_np[slot]  # sync: none — host memory the step's own write just filled
        if self._found is None and not math.isfinite(value):
            self._found = (self.ring.step_of(slot), float(value))

    def check_before_reuse(self, row: int) -> None:
        """Check every watched row at least a ring older than ``row`` before ``row`` reuses a slot.

        Call it after the flusher handed out ``row``'s slot (so those rows were harvested and their
        copies completed) and before the row is written. A non-finite loss found here is reported
        by the next :meth:`poll`.
        """
        pending = self.pending
        oldest = row - self.capacity
        while pending and pending[0][1] <= oldest:
            slot, _ = pending.popleft()
            value = float(self.ring.guard_np[slot])  # complete: its row was harvested
            if self._found is None and not math.isfinite(value):
                self._found = (self.ring.step_of(slot), value)

    def poll(self) -> tuple[int, float] | None:
        """(step, loss) of the first non-finite loss the device has delivered, else None."""
        if self._found is not None:
            hit, self._found = self._found, None
            return hit
        pending, clock, guard = self.pending, self.clock, self.ring.guard_np
        while pending and clock.end_done(pending[0][0]):
            slot, _ = pending.popleft()
            value = float(guard[slot])  # a pinned host float the device finished writing
            if not math.isfinite(value):
                return self.ring.step_of(slot), value
        return None
