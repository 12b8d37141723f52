"""When to flush, what a flushed block is, how it is read back, and when a ring slot may be reused.

The training thread calls :meth:`Flusher.claim` before it writes a row and :meth:`Flusher.flush`
when :meth:`Flusher.due`. The :class:`Block` a flush returns is the whole hand-over: the pipeline
polls :meth:`Block.ready` (a non-blocking device query) every :data:`POLL_INTERVAL` seconds, then
calls :meth:`Block.read`, which copies the rows out of the ring into a :class:`BlockData` and
releases their slots. Nothing beyond this module knows the ring's layout, its markers or its slots.
The only place the training thread can wait is ``claim``, and only when the pipeline is a whole
ring behind (the device lags by ``capacity`` steps, or the sinks apply backpressure).

This module does not import torch. What crosses to the pipeline is a :class:`BlockData` (defined
with the decoders, :mod:`batchtap.metrics.decoding`, where any capture can make one).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from batchtap.metrics.decoding import FACTS, INTEGER_FACTS, SLOT_FACTS, BlockData

if TYPE_CHECKING:
    from batchtap.capture.clock import DeviceGate, StepClock
    from batchtap.capture.ring import MetricRing

__all__ = ["Block", "BlockData", "FACTS", "Flusher", "INTEGER_FACTS", "POLL_INTERVAL", "SLOT_FACTS", "wait_until"]

#: seconds between polls of a device marker (a block's copy, ``log()`` values) or of a full
#: shared-memory segment: short sleeps that leave the GIL to the training thread
POLL_INTERVAL = 2e-4


def wait_until(ready: Callable[[], bool], gate: DeviceGate | None = None) -> None:
    """Poll (never block on) the device until ``ready()``; each query inside ``gate``."""
    while True:
        if gate is None:
            if ready():
                return
        else:
            with gate.querying():
                if ready():
                    return
        time.sleep(POLL_INTERVAL)  # polling keeps the GIL free for the training thread


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """Rows ``[first_row, last_row)`` of ``source``'s ring whose device->host copy was queued
    before ``marker``: what a flush hands to the pipeline."""

    first_row: int
    last_row: int
    marker: object
    source: Flusher = dataclasses.field(repr=False, compare=False)

    def __len__(self) -> int:
        return self.last_row - self.first_row

    def ready(self) -> bool:
        """Whether the copy completed (one non-blocking device query; call inside the gate)."""
        return self.source.clock.marker_done(self.marker)

    def read(self, gate: DeviceGate | None = None) -> BlockData:
        """Wait (polling) until the copy completed, read the rows, and release their slots.

        Every device query runs inside ``gate``. The slots are released even when reading fails,
        or the training thread would wait for them forever.
        """
        try:
            wait_until(self.ready, gate)
            return self._rows(gate)
        finally:
            self.release()

    def read_now(self, gate: DeviceGate) -> BlockData | None:
        """The rows (slots released) when the copy completed and ``gate`` is open now, else None
        at once (for callers that must not wait)."""
        with gate.open_now() as open_:
            if not (open_ and self.ready()):
                return None
            try:
                return self._rows(gate)
            finally:
                self.release()

    def release(self) -> None:
        """The rows were read (or cannot be): their slots may be reused."""
        self.source.release(self)

    def _rows(self, gate: DeviceGate | None) -> BlockData:
        ring, clock = self.source.ring, self.source.clock
        first, last = self.first_row, self.last_row
        slots = ring.slots(first, last)
        order = slots.tolist()  # sync: none — host ints of the slot indices, no device value
        if gate is None:
            elapsed = clock.take_elapsed(order)
        else:
            with gate.querying():
                elapsed = clock.take_elapsed(order)
        # the facts as one float64 table (steps are exact in it up to 2**53), integers cast back
        table = np.array([ring.facts[s] for s in order], dtype=np.float64).reshape(len(order), len(SLOT_FACTS))
        facts = {name: table[:, i] for i, name in enumerate(SLOT_FACTS)}
        for name in INTEGER_FACTS:
            facts[name] = facts[name].astype(np.int64)
        host = np.array([ring.host_rows[s] for s in order], dtype=np.float64).reshape(len(order), ring.host_width)
        return BlockData(
            device_values=ring.pinned_np[slots].astype(np.float64),
            host_values=host,
            step_time=np.array(elapsed, dtype=np.float64),
            **facts,
        )


class Flusher:
    """Flush scheduling and slot ownership for one :class:`MetricRing`.

    Args:
        ring: the ring to flush.
        clock: the step clock (gives block markers and step times).
        flush_every: flush after this many unflushed rows.
        flush_seconds: flush when the oldest unflushed row is this old; None flushes on the count
            only (in a process group every rank must flush at the same steps).
    """

    def __init__(
        self,
        ring: MetricRing,
        clock: StepClock,
        *,
        flush_every: int,
        flush_seconds: float | None,
    ) -> None:
        self.ring = ring
        self.capacity = ring.capacity  # read at every claim()
        self.clock = clock
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.rows = 0  # rows written so far
        self.flushed = 0  # rows whose copy has been queued
        self.released = (
            0  # rows read back by the pipeline; their slots may be reused (read freely, written under the condition)
        )
        self._released_cv = threading.Condition()
        self.last_flush = time.monotonic()
        self.waits = 0  # how often claim() had to wait (reported by benchmarks)

    def claim(self, row: int) -> int:
        """The slot for ``row``, once the row ``capacity`` before it was released."""
        if row - self.capacity >= self.released:
            # sync: backpressure. The pipeline is a whole ring behind (device lag or blocked sinks);
            # waiting here is the only way not to overwrite rows that were never read.
            with self._released_cv:
                self.waits += 1
                self._released_cv.wait_for(lambda: row - self.capacity < self.released)
        return row % self.capacity

    def commit_row(self) -> None:
        """The row :meth:`claim` handed out was written (rows are written in order)."""
        self.rows += 1

    def due(self) -> bool:
        """Whether the unflushed rows call for a flush now (count or age)."""
        pending = self.rows - self.flushed
        if pending >= self.flush_every:
            return True
        if self.flush_seconds is None:
            return False
        return pending > 0 and time.monotonic() - self.last_flush >= self.flush_seconds

    def flush(self, *, empty_ok: bool = False) -> Block | None:
        """Queue the copy of every unflushed row and return its block.

        Returns None when nothing is new, unless ``empty_ok`` (an empty block still carries events
        through the pipeline, e.g. at the end of a distributed run).
        """
        self.last_flush = time.monotonic()
        if self.rows == self.flushed and not empty_ok:
            return None
        first, last = self.flushed, self.rows
        self.ring.copy_rows(first, last)
        block = Block(first, last, self.clock.block_marker(), self)
        self.flushed = last
        return block

    def release(self, block: Block) -> None:
        """Mark ``block``'s slots reusable (once its rows were read back)."""
        with self._released_cv:
            self.released = max(self.released, block.last_row)
            self._released_cv.notify_all()
