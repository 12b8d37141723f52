"""A ring of flushed blocks in shared memory, between the training process and the pipeline process.

One segment per run (its width is the run's), made by the training process. ``slots`` block slots
of up to ``max_rows`` rows; each row is the run's device and host columns followed by the row's
facts (``batchtap.metrics.decoding.FACTS``), all float64. Two
counters in the segment's header order the hand-over:

* ``published``: blocks the training process has written (it writes slot ``n % slots``, then bumps
  the counter);
* ``consumed``: blocks the pipeline process has processed and handed to its sinks (it bumps the
  counter only then, so a pipeline process that dies mid-block leaves the block in place for its
  successor).

The training process writes a slot only while ``published - consumed < slots``; otherwise it waits
(the pipeline is a whole segment behind). A segment outlives the process that wrote it: when the
training process is killed, the pipeline process still reads every published block.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.util
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

from batchtap import _stale  # owner-named segments, removed by our rule (see batchtap._stale)

if TYPE_CHECKING:
    from batchtap.metrics.decoding import BlockData

# numpy and the block type load at a run's first chain, not with this module: a pipeline process
# answers a run's start before it needs them


__all__ = ["BlockSegment", "SegmentShape"]

_HEADER = 2  # published, consumed
_SLOT_HEADER = 1  # rows in the slot


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentShape:
    """The geometry of a segment (what the pipeline process needs to attach to it)."""

    name: str
    slots: int
    max_rows: int
    device_width: int
    host_width: int

    @property
    def width(self) -> int:
        from batchtap.metrics.decoding import FACTS

        return self.device_width + self.host_width + len(FACTS)

    @property
    def nbytes(self) -> int:
        return 8 * (_HEADER + self.slots * (_SLOT_HEADER + self.max_rows * self.width))


class BlockSegment:
    """See the module docstring. Make it with :meth:`create` (training process) or :meth:`attach`
    (pipeline process)."""

    def __init__(self, shm: shared_memory.SharedMemory, shape: SegmentShape, *, owner: bool) -> None:
        import numpy as np

        self.shm = shm
        self.shape = shape
        self.owner = owner
        words = np.ndarray((shape.nbytes // 8,), dtype=np.float64, buffer=shm.buf)
        self._counters = np.ndarray((_HEADER,), dtype=np.int64, buffer=shm.buf)
        body = words[_HEADER:].reshape(shape.slots, _SLOT_HEADER + shape.max_rows * shape.width)
        self._rows = body[:, 0]
        self._data = body[:, _SLOT_HEADER:].reshape(shape.slots, shape.max_rows, shape.width)

    @classmethod
    def create(cls, *, slots: int, max_rows: int, device_width: int, host_width: int) -> BlockSegment:
        probe = SegmentShape("", slots, max_rows, device_width, host_width)
        _stale.sweep_segments(once=True)  # segments of dead batchtap processes on this host
        shm = shared_memory.SharedMemory(name=_stale.segment_name(), create=True, size=max(probe.nbytes, 8))
        _stale.untrack(shm.name)  # no "leaked shared_memory" warning at exit; see batchtap._stale
        segment = cls(shm, dataclasses.replace(probe, name=shm.name), owner=True)
        segment._counters[:] = 0
        return segment

    @classmethod
    def attach(cls, shape: SegmentShape) -> BlockSegment:
        shm = shared_memory.SharedMemory(name=shape.name)
        # Kept out of the resource tracker (it would warn of a leak on the user's stderr when the
        # training process is killed alone; see batchtap._stale); a segment whose owner
        # died is removed when this process exits (or by the next batchtap process on the host).
        _stale.untrack(shm.name)
        multiprocessing.util.Finalize(None, _stale.unlink_if_owner_gone, (shape.name,), exitpriority=0)
        return cls(shm, shape, owner=False)

    @property
    def published(self) -> int:
        return int(self._counters[0])

    @property
    def consumed(self) -> int:
        return int(self._counters[1])

    def has_room(self) -> bool:
        return self.published - self.consumed < self.shape.slots

    # ------------------------------------------------------------------ training process

    def publish(self, data: BlockData) -> int:
        """Write ``data`` into the next slot and return its sequence number (call only while
        :meth:`has_room`: the sender waits for room, polling, never here)."""
        from batchtap.metrics.decoding import FACTS

        n = len(data)
        if n > self.shape.max_rows:
            raise ValueError(f"a block of {n} rows does not fit a segment slot of {self.shape.max_rows} rows")
        if not self.has_room():
            raise ValueError(f"segment {self.shape.name} is full: {self.shape.slots} blocks not yet consumed")
        seq = self.published
        slot = seq % self.shape.slots
        dw, hw = self.shape.device_width, self.shape.host_width
        rows = self._data[slot, :n]
        rows[:, :dw] = data.device_values
        rows[:, dw : dw + hw] = data.host_values
        for i, fact in enumerate(FACTS):
            rows[:, dw + hw + i] = getattr(data, fact)
        self._rows[slot] = n
        self._counters[0] = seq + 1  # last: the slot is complete before it is announced
        return seq

    # ------------------------------------------------------------------ pipeline process

    def read(self, seq: int) -> BlockData:
        """A copy of published block ``seq`` (safe to keep after the slot is reused)."""
        import numpy as np

        from batchtap.metrics.decoding import FACTS, INTEGER_FACTS, BlockData

        slot = seq % self.shape.slots
        n = int(self._rows[slot])
        dw, hw = self.shape.device_width, self.shape.host_width
        rows = self._data[slot, :n].copy()
        facts = {fact: rows[:, dw + hw + i] for i, fact in enumerate(FACTS)}
        for fact in INTEGER_FACTS:  # exact: float64 holds integers up to 2**53
            facts[fact] = facts[fact].astype(np.int64)
        return BlockData(device_values=rows[:, :dw], host_values=rows[:, dw : dw + hw], **facts)

    def consume(self, seq: int) -> None:
        """Block ``seq`` was processed and handed to the sinks: its slot may be reused."""
        self._counters[1] = max(self.consumed, seq + 1)

    def close(self) -> None:
        """Unmap (and, for the owner, remove) the segment."""
        self._counters = self._rows = self._data = None  # type: ignore[assignment]
        try:
            self.shm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        if self.owner or _stale.segment_owner_gone(self.shape.name):  # our owner rule, not the tracker's
            _stale.unlink_segment(self.shape.name)
