"""The fast channel: the host sees a step's loss within the device's lag, without a sync.

Each captured step copies its loss into a pinned slot (see :class:`MetricRing`) right after writing
its row, and the step's end mark follows that copy. :meth:`LossGuard.poll` reads the slots whose end
mark the device has passed (a non-blocking query), oldest first. On the CPU the copy is done by the
time ``step()`` returns, so a NaN is seen at the step that produced it.
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
        self.clock = clock
        self._pending: collections.deque[int] = collections.deque()  # slots, oldest first

    def track(self, slot: int) -> None:
        """Watch ``slot``, written by the step that was just captured."""
        self._pending.append(slot)

    def poll(self) -> tuple[int, float] | None:
        """(step, loss) of the first non-finite loss the device has delivered, else None."""
        pending, clock, guard = self._pending, self.clock, self.ring.guard_np
        while pending and clock.end_done(pending[0]):
            slot = pending.popleft()
            value = float(guard[slot])  # a pinned host float the device finished writing
            if not math.isfinite(value):
                return int(self.ring.step[slot]), value
        return None
