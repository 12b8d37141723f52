"""The device ring: preallocated storage for captured steps, on the device and mirrored on the host.

* ``device_rows`` — ``[capacity, device_width]`` float32 on the training device. A step writes its
  row with one ``torch.stack(..., out=row)``: no allocation, no host read.
* ``pinned`` — a page-locked host mirror of the same shape. A flush copies a block of rows into the
  same slots with ``non_blocking=True``; the host reads them only after the flush's marker completed.
* ``guard`` — a page-locked float per slot receiving the step's loss right away (one tiny
  non-blocking copy per step), so the host learns of a NaN within the device's lag instead of at the
  next flush.
* host facts — per slot, one tuple of step, epoch, batch, wall time, samples, data wait and tokens
  (``batchtap.capture.flush.SLOT_FACTS``), and the metrics' host values: Python objects stored by
  reference, the cheapest write there is (a numpy element write costs several times a list store,
  and a step makes eight). A flushed :class:`~batchtap.capture.flush.Block` turns its tuples into
  arrays when the pipeline reads it back.

A slot is reused ``capacity`` rows later, only once its previous row was harvested (see
:class:`~batchtap.capture.flush.Flusher`), so neither the device row, the pinned slot, the host
arrays nor the slot's events are overwritten before they were read.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import numpy as np
import torch

from batchtap.metrics.base import RowWriter, StepInputs, settle_of, write_values

__all__ = ["MetricRing", "SlotWriters"]


class SlotWriters:
    """The metrics' row writers of one short-path closure (see ``Metric.row_writer``): together
    they write every device column of a row, and the ring records them as the owner of the slots
    they wrote last.

    Attributes:
        writers: the row writers, called in order.
        settles: the ``settle`` of those that leave columns to the flush (see ``with_settle``).
    """

    __slots__ = ("writers", "settles")

    def __init__(self, writers: Sequence[RowWriter]) -> None:
        self.writers = tuple(writers)
        self.settles = tuple(s for s in map(settle_of, self.writers) if s is not None)


class MetricRing:
    """Preallocated per-step storage (see the module docstring).

    Args:
        capacity: number of slots.
        device_width: float32 device columns per row (may be 0).
        host_width: float64 host columns per row (may be 0).
        device: the training device.
        guard_column: device column copied to the host every step (the loss), or None.
    """

    def __init__(
        self,
        *,
        capacity: int,
        device_width: int,
        host_width: int,
        device: torch.device,
        guard_column: int | None,
    ) -> None:
        self.capacity = capacity
        self.device = device
        self.device_width = device_width
        self.host_width = host_width
        self.guard_column = guard_column
        # Pinned memory is what lets a device->host copy run asynchronously; on the CPU it buys nothing.
        pin = device.type == "cuda"
        self.non_blocking = pin
        self.device_rows = torch.zeros((capacity, device_width), dtype=torch.float32, device=device)
        with _real_memory():
            self.pinned = host_buffer((capacity, device_width), pin=pin)
            self.guard = host_buffer((capacity,), pin=pin)
            # numpy views made once here; later host reads go through them, never through torch.
            self.pinned_np = self.pinned.numpy()
            self.guard_np = self.guard.numpy()
        # (step, epoch, batch, wall_time, samples, data_time, tokens) per slot: flush.SLOT_FACTS
        self.facts: list[tuple[int, int, int, float, float, float, float]] = [_NO_FACTS] * capacity
        self.host_rows: list[Sequence[float]] = [(0.0,) * host_width] * capacity
        # Views made once: slicing costs a dispatcher call per view, and step() runs every batch.
        self.slot_rows = [self.device_rows.select(0, i) for i in range(capacity)]
        # per slot, the short path's writers that wrote its row last (None: a whole-row write);
        # writers leave constant columns alone, so they must know when a slot's row is not theirs,
        # and some leave columns to the flush, which must know whose rows it copies
        self.row_writers: list[SlotWriters | None] = [None] * capacity
        self.settling = False  # some writers of this ring leave columns to the flush
        # CUDA: per slot, the guard's pinned float and the row's loss column (the per-step copy)
        self.guard_pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # the guard's floats are the ring's own loss column: a step's loss is readable on the host
        # as soon as its write returned (nothing to wait for, nothing to poll)
        self.loss_in_place = False
        if guard_column is not None and device_width:
            if device.type == "cpu":
                # The ring already is host memory: the guard reads the loss column in place.
                self.guard_np = self.device_rows.numpy()[:, guard_column]
                self.loss_in_place = True
            else:
                self.guard_pairs = [
                    (self.guard.narrow(0, i, 1), self.slot_rows[i].narrow(0, guard_column, 1)) for i in range(capacity)
                ]

    def write(
        self,
        slot: int,
        device_values: list[torch.Tensor],
        host_values: Sequence[float],
        *,
        step: int,
        epoch: int,
        batch: int,
        wall_time: float,
        samples: float,
        data_time: float,
        tokens: float = math.nan,
        head: torch.Tensor | None = None,
    ) -> None:
        """Store one step in ``slot``: one device op for the row, one tiny copy for the guard.

        ``head`` (an accumulated optimizer step) fills the row's first ``len(head)`` columns;
        ``device_values`` then fill the rest.
        """
        if head is not None:
            # one kernel for the whole row: the head's columns enter the stack as views
            self.write_device(slot, [*head.unbind(0), *device_values])
        else:
            self.write_device(slot, device_values)
        self.host_rows[slot] = host_values
        self.facts[slot] = (step, epoch, batch, wall_time, samples, data_time, tokens)

    def write_device(self, slot: int, values: Sequence[torch.Tensor]) -> None:
        """The device part of :meth:`write`: the row's values into ``slot``, and the NaN guard's copy
        of its loss."""
        self.row_writers[slot] = None
        if self.device_width:
            write_values(self.slot_rows[slot], values)
        if self.guard_pairs is not None:
            self._copy_guard(slot)

    def slot_writers(self, writers: Sequence[RowWriter]) -> SlotWriters:
        """The owner :meth:`write_with` takes for ``writers`` (which must cover every device column:
        none when the row has no device columns)."""
        owner = SlotWriters(writers)
        self.settling = self.settling or bool(owner.settles)
        return owner

    def write_with(self, slot: int, owner: SlotWriters, inputs: StepInputs) -> None:
        """:meth:`write_device` by the metrics' own writers (see ``Metric.row_writer``): each writes
        its columns of the slot's row in place (some complete theirs at the flush)."""
        owners = self.row_writers
        fresh = owners[slot] is not owner
        owners[slot] = owner
        for write in owner.writers:
            write(inputs, slot, fresh)
        if self.guard_pairs is not None:
            self._copy_guard(slot)

    def _copy_guard(self, slot: int) -> None:
        """Queue the copy of the slot's loss to its page-locked guard float (CUDA)."""
        assert self.guard_pairs is not None
        target, source = self.guard_pairs[slot]
        target.copy_(source, non_blocking=self.non_blocking)

    def step_of(self, slot: int) -> int:
        """The step whose row ``slot`` holds now."""
        return self.facts[slot][0]

    def copy_rows(self, first_row: int, last_row: int) -> None:
        """Queue the device->pinned copy of rows ``[first_row, last_row)`` (at most ``capacity``)."""
        if not self.device_width or last_row <= first_row:
            return
        for start, length in self.segments(first_row, last_row):
            if self.settling:
                self._settle(start, length)
            self.pinned.narrow(0, start, length).copy_(
                self.device_rows.narrow(0, start, length), non_blocking=self.non_blocking
            )

    def _settle(self, start: int, length: int) -> None:
        """Let the writers that left columns to the flush complete them in slots ``[start, start +
        length)``: once per run of consecutive slots they wrote last (one run in a steady loop)."""
        owners = self.row_writers
        end = start + length
        block = owners[start:end]
        if block.count(block[0]) == length:  # one owner for the whole run (a C-speed scan)
            runs = [(start, length, block[0])]
        else:
            runs, i = [], start
            while i < end:
                owner, j = owners[i], i + 1
                while j < end and owners[j] is owner:
                    j += 1
                runs.append((i, j - i, owner))
                i = j
        for first, count, owner in runs:
            if owner is not None:
                for settle in owner.settles:
                    settle(first, count)

    def segments(self, first_row: int, last_row: int) -> list[tuple[int, int]]:
        """The (slot, length) runs covering rows ``[first_row, last_row)``: one, or two on wrap-around."""
        count = last_row - first_row
        if count > self.capacity:
            raise ValueError(f"cannot address {count} rows in a ring of {self.capacity}")
        start = first_row % self.capacity
        first_len = min(count, self.capacity - start)
        runs = [(start, first_len)]
        if first_len < count:
            runs.append((0, count - first_len))
        return runs

    def slots(self, first_row: int, last_row: int) -> np.ndarray:
        """Slot indices of rows ``[first_row, last_row)`` in row order."""
        return np.arange(first_row, last_row) % self.capacity


_NO_FACTS = (0, 0, 0, 0.0, 0.0, math.nan, math.nan)


def host_buffer(shape: tuple[int, ...], *, pin: bool) -> torch.Tensor:
    """A zeroed float32 host buffer, page-locked when ``pin`` (needed for asynchronous copies)."""
    return torch.zeros(shape, dtype=torch.float32, pin_memory=pin)


def _real_memory() -> contextlib.AbstractContextManager[object]:
    """Host buffers are real memory even when the step is traced under ``FakeTensorMode``
    (torch.compile tracing, or the tests that prove the CUDA path issues no host read)."""
    from torch._subclasses import fake_tensor

    unset = getattr(fake_tensor, "unset_fake_temporarily", None)
    return unset() if unset is not None else contextlib.nullcontext()
