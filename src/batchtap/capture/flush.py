"""When to flush, what a flushed block is, and when a ring slot may be reused.

The training thread calls :meth:`Flusher.claim` before it writes a row and :meth:`Flusher.flush`
when :meth:`Flusher.due`; the pipeline reads each block back (``batchtap.pipeline.harvest``) and
then calls :meth:`Flusher.release`. The only place the training thread can wait is ``claim``, and only when the
pipeline is a whole ring behind (the device lags by ``capacity`` steps, or the sinks apply
backpressure).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from batchtap.capture.clock import StepClock
from batchtap.capture.ring import MetricRing

__all__ = ["Block", "BlockData", "Flusher"]


@dataclasses.dataclass(frozen=True, slots=True)
class Block:
    """Rows ``[first_row, last_row)`` whose device->host copy was queued before ``marker``."""

    first_row: int
    last_row: int
    marker: object


@dataclasses.dataclass(frozen=True, slots=True)
class BlockData:
    """A block's rows read back on the host (copies, safe to keep after the slots are reused)."""

    device_values: np.ndarray  # [n, device_width] float64
    host_values: np.ndarray  # [n, host_width] float64
    step: np.ndarray
    epoch: np.ndarray
    batch: np.ndarray
    wall_time: np.ndarray
    samples: np.ndarray
    data_time: np.ndarray
    step_time: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.step)


class Flusher:
    """Flush scheduling and slot ownership for one :class:`MetricRing`.

    Args:
        ring: the ring to flush.
        clock: the step clock (gives block markers and step times).
        flush_every: flush after this many unflushed rows.
        flush_seconds: flush when the oldest unflushed row is this old; None flushes on the count
            only (in a process group every rank must flush at the same steps).
        poll_interval: pipeline-thread sleep between marker polls, seconds.
    """

    def __init__(
        self,
        ring: MetricRing,
        clock: StepClock,
        *,
        flush_every: int,
        flush_seconds: float | None,
        poll_interval: float = 2e-4,
    ) -> None:
        self.ring = ring
        self.capacity = ring.capacity  # read at every claim()
        self.clock = clock
        self.flush_every = flush_every
        self.flush_seconds = flush_seconds
        self.poll_interval = poll_interval
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
        block = Block(first, last, self.clock.block_marker())
        self.flushed = last
        return block

    def release(self, block: Block) -> None:
        """Mark ``block``'s slots reusable (once its rows were read back)."""
        with self._released_cv:
            self.released = max(self.released, block.last_row)
            self._released_cv.notify_all()
