"""The capture layer on its own: ring slots, flush scheduling, slot ownership, the loss guard."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from batchtap.capture.clock import HostClock, clock_for
from batchtap.capture.flush import Flusher
from batchtap.capture.guard import LossGuard
from batchtap.capture.loader import timed_batches
from batchtap.capture.ring import MetricRing
from batchtap.metrics.base import with_settle

CPU = torch.device("cpu")


def _ring(capacity: int = 4, device_width: int = 2, host_width: int = 1, guard: int | None = 0) -> MetricRing:
    return MetricRing(
        capacity=capacity, device_width=device_width, host_width=host_width, device=CPU, guard_column=guard
    )


def _write(ring: MetricRing, flusher: Flusher, step: int, loss: float) -> int:
    """What Tap.step does for one row, in the same order."""
    slot = flusher.claim(flusher.rows)
    flusher.clock.mark_start(slot)
    ring.write(
        slot,
        [torch.tensor(loss), torch.tensor(float(step))],
        [step * 10.0],
        step=step,
        epoch=0,
        batch=step,
        wall_time=1000.0 + step,
        samples=8.0,
        data_time=0.001,
    )
    flusher.clock.mark_end(slot)
    flusher.rows += 1
    return slot


def test_segments_cover_a_wrapped_block_in_row_order() -> None:
    ring = _ring(capacity=4)
    assert ring.segments(0, 3) == [(0, 3)]
    assert ring.segments(3, 6) == [(3, 1), (0, 2)]
    assert ring.slots(3, 6).tolist() == [3, 0, 1]
    with pytest.raises(ValueError, match="cannot address 5 rows in a ring of 4"):
        ring.segments(0, 5)


def test_the_flush_lets_writers_settle_each_run_of_slots_they_wrote_last_before_the_copy() -> None:
    ring = _ring(capacity=8, device_width=1, host_width=0, guard=None)
    settled: list[tuple[str, int, int]] = []

    def writers(name: str, settles: bool) -> list:  # type: ignore[type-arg]
        def write(inputs: object, slot: int, fresh: bool) -> None:
            ring.device_rows[slot, 0] = -1.0  # left for settle to complete

        def settle(start: int, length: int) -> None:
            ring.device_rows[start : start + length, 0] = float(len(settled) + 1)
            settled.append((name, start, length))

        return [with_settle(write, settle)] if settles else [write]

    a, b, plain = (
        ring.slot_writers(writers("a", True)),
        ring.slot_writers(writers("b", True)),
        ring.slot_writers(writers("plain", False)),
    )
    assert ring.settling
    owner_of = {0: a, 1: a, 2: None, 3: a, 4: b, 5: b, 6: plain, 7: a}  # None: the general path's row
    for slot, owner in owner_of.items():
        if owner is None:
            ring.write_device(slot, [torch.tensor(5.0)])
        else:
            ring.write_with(slot, owner, None)  # type: ignore[arg-type]
    ring.copy_rows(6, 14)  # slots 6, 7, then 0..5: a wrapped block
    assert settled == [("a", 7, 1), ("a", 0, 2), ("a", 3, 1), ("b", 4, 2)]
    assert ring.pinned[:, 0].tolist() == [2.0, 2.0, 5.0, 3.0, 4.0, 4.0, -1.0, 1.0]  # settled before the copy


def test_rows_survive_many_wraps_and_come_back_in_step_order() -> None:
    ring = _ring(capacity=4)
    flusher = Flusher(ring, HostClock(4), flush_every=2, flush_seconds=None)
    seen: list[int] = []
    for step in range(23):
        _write(ring, flusher, step, loss=step / 2)
        if flusher.due():
            block = flusher.flush()
            assert block is not None
            data = block.read()
            assert data.device_values[:, 0].tolist() == [s / 2 for s in data.step.tolist()]
            assert data.device_values[:, 1].tolist() == data.step.tolist()
            assert data.host_values[:, 0].tolist() == [s * 10.0 for s in data.step.tolist()]
            assert (data.step_time >= 0).all()
            seen += data.step.tolist()
    last = flusher.flush()
    assert last is not None
    seen += last.read().step.tolist()
    assert seen == list(range(23))


def test_a_slot_is_not_reused_before_its_row_was_released() -> None:
    ring = _ring(capacity=2)
    flusher = Flusher(ring, HostClock(2), flush_every=2, flush_seconds=None)
    _write(ring, flusher, 0, 1.0)
    _write(ring, flusher, 1, 2.0)
    block = flusher.flush()
    assert block is not None
    claimed = threading.Event()

    def third_row() -> None:
        flusher.claim(2)  # slot 0 again: must wait until rows 0 and 1 were read
        claimed.set()

    writer = threading.Thread(target=third_row)
    writer.start()
    assert not claimed.wait(0.2), "claim() handed out a slot whose row was never read"
    data = block.read()
    assert claimed.wait(5)
    writer.join()
    assert data.step.tolist() == [0, 1] and flusher.waits == 1


class _Monotonic:
    """``time.monotonic`` for the flusher, moved only by the test: ages are what the test says."""

    def __init__(self) -> None:
        self.now = 64.0  # binary-exact times throughout: an age is exactly what the test added

    def monotonic(self) -> float:
        return self.now


def test_due_by_count_or_by_age_and_never_when_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import batchtap.capture.flush as flush_module

    clock = _Monotonic()
    monkeypatch.setattr(flush_module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    ring = _ring(capacity=8)
    flusher = Flusher(ring, HostClock(8), flush_every=3, flush_seconds=0.5)
    assert not flusher.due()
    clock.now += 0.75
    assert not flusher.due(), "an empty ring is never due, however old the last flush"
    _write(ring, flusher, 0, 1.0)
    assert flusher.due(), "one row older than flush_seconds is due"
    flusher.flush()
    _write(ring, flusher, 1, 1.0)
    clock.now += 0.25
    _write(ring, flusher, 2, 1.0)
    assert not flusher.due(), "2 rows < flush_every, 0.25 s < flush_seconds: not due"
    clock.now += 0.25
    assert flusher.due(), "exactly flush_seconds since the last flush: due by age"
    flusher.flush()
    for step in (3, 4):
        _write(ring, flusher, step, 1.0)
    assert not flusher.due()
    _write(ring, flusher, 5, 1.0)
    assert flusher.due(), "flush_every rows are due at once, whatever their age"
    count_only = Flusher(_ring(capacity=8), HostClock(8), flush_every=3, flush_seconds=None)
    _write(count_only.ring, count_only, 0, 1.0)
    clock.now += 3600.0
    assert not count_only.due(), "flush_seconds=None flushes on the count only (process groups)"


def test_flush_with_nothing_new_returns_none_unless_asked_for_an_empty_block() -> None:
    flusher = Flusher(_ring(), HostClock(4), flush_every=2, flush_seconds=None)
    assert flusher.flush() is None
    empty = flusher.flush(empty_ok=True)
    assert empty is not None and len(empty.read()) == 0


def test_a_step_without_a_start_mark_has_no_step_time() -> None:
    ring = _ring(capacity=4)
    clock = HostClock(4)
    flusher = Flusher(ring, clock, flush_every=2, flush_seconds=None)
    slot = flusher.claim(0)
    ring.write(
        slot,
        [torch.tensor(1.0), torch.tensor(0.0)],
        [0.0],
        step=0,
        epoch=0,
        batch=0,
        wall_time=0.0,
        samples=1.0,
        data_time=math.nan,
    )
    clock.mark_end(slot)
    flusher.rows += 1
    _write(ring, flusher, 1, 1.0)
    block = flusher.flush()
    assert block is not None
    times = block.read().step_time
    assert math.isnan(times[0]) and times[1] >= 0


@pytest.mark.parametrize("queued", [False, True], ids=["cpu_in_place", "device_queue"])
def test_guard_reports_the_first_non_finite_loss_once(queued: bool) -> None:
    ring = _device_ring(capacity=4) if queued else _ring(capacity=4)
    flusher = Flusher(ring, HostClock(4), flush_every=100, flush_seconds=None)
    guard = LossGuard(ring, flusher.clock)
    for step, loss in enumerate([0.5, 0.4, math.inf]):
        guard.track(_write(ring, flusher, step, loss), step)
    # on the CPU each row is checked in place when it is tracked: nothing is queued
    assert len(guard.pending) == (3 if queued else 0)
    assert guard.poll() == (2, math.inf)
    assert guard.poll() is None, "a reported slot is not reported again"
    guard.track(_write(ring, flusher, 3, math.nan), 3)
    step, value = guard.poll()  # type: ignore[misc]
    assert step == 3 and math.isnan(value)
    assert not guard.pending


def _device_ring(capacity: int) -> MetricRing:
    """A ring whose loss reaches the host through the guard's queue, as on a device (on the CPU
    the guard checks each row in place when it is tracked, and nothing can lag)."""
    ring = _ring(capacity=capacity)
    ring.loss_in_place = False
    return ring


class _LaggingClock(HostClock):
    """A device that never lets poll() see an end mark pass: the host runs a ring ahead of it.
    (Its block markers complete, so the pipeline harvests blocks and slots come round again.)"""

    def end_done(self, slot: int) -> bool:
        return False


def test_guard_checks_a_slots_old_row_before_a_lagging_device_gets_it_overwritten() -> None:
    ring = _device_ring(capacity=4)
    clock = _LaggingClock(4)
    flusher = Flusher(ring, clock, flush_every=2, flush_seconds=None)
    guard = LossGuard(ring, clock)
    hits = []
    for row, loss in enumerate([0.5, math.nan, 0.4, 0.3, 0.2, 0.1, 0.05, 0.01]):
        slot = flusher.claim(row)
        guard.check_before_reuse(row)  # what Tap.step does between claim and write
        ring.write(
            slot,
            [torch.tensor(loss), torch.tensor(0.0)],
            [0.0],
            step=row,
            epoch=0,
            batch=row,
            wall_time=0.0,
            samples=1.0,
            data_time=math.nan,
        )
        clock.mark_end(slot)
        guard.track(slot, row)
        flusher.rows += 1
        if flusher.due():
            block = flusher.flush()
            assert block is not None
            block.read()
        hits.append(guard.poll())
    # row 5 reused row 1's slot: the NaN of step 1 was checked just before it was overwritten
    assert hits[:5] == [None] * 5
    step, value = hits[5]  # type: ignore[misc]
    assert step == 1 and math.isnan(value)
    assert hits[6:] == [None, None]


def test_cpu_guard_reads_the_loss_column_in_place() -> None:
    ring = _ring(capacity=4, guard=1)
    ring.write(
        2,
        [torch.tensor(0.25), torch.tensor(7.5)],
        [0.0],
        step=5,
        epoch=0,
        batch=5,
        wall_time=0.0,
        samples=1.0,
        data_time=0.0,
    )
    assert ring.guard_np[2] == 7.5
    assert np.shares_memory(ring.guard_np, ring.device_rows.numpy())


def test_clock_for_picks_the_host_clock_off_cuda() -> None:
    assert isinstance(clock_for(CPU, 4), HostClock)


def test_timed_batches_flags_the_last_batch_with_and_without_a_length() -> None:
    with_len = [(b, last) for b, waited, last in timed_batches([1, 2, 3], need_last=True)]
    without_len = [(b, last) for b, waited, last in timed_batches(iter([1, 2, 3]), need_last=True)]
    assert with_len == without_len == [(1, False), (2, False), (3, True)]
    assert all(w >= 0 for _, w, _ in timed_batches(iter(range(5)), need_last=True))
    assert list(timed_batches(iter([]), need_last=True)) == []


def test_timed_batches_measures_the_wait_for_a_slow_loader() -> None:
    def slow() -> object:
        for i in range(2):
            time.sleep(0.03)
            yield i

    waits = [w for _, w, _ in timed_batches(slow(), need_last=False)]
    assert len(waits) == 2 and all(w >= 0.025 for w in waits)


def test_guard_checks_a_wrapped_row_only_once_a_whole_ring_has_passed_it() -> None:
    # After the ring wrapped, a row's slot number is smaller than the row: the guard must compare
    # rows, not slots. Step 6 (slot 2 of 4) holds a NaN; its copy is final once row 10 takes the
    # slot again, not before (on a device, an earlier read could see a copy still in flight).
    ring = _device_ring(capacity=4)
    clock = _LaggingClock(4)
    flusher = Flusher(ring, clock, flush_every=2, flush_seconds=None)
    guard = LossGuard(ring, clock)
    hits = []
    for row in range(12):
        slot = flusher.claim(row)
        guard.check_before_reuse(row)
        loss = math.nan if row == 6 else 1.0 / (row + 1)
        ring.write(
            slot,
            [torch.tensor(loss), torch.tensor(0.0)],
            [0.0],
            step=row,
            epoch=0,
            batch=row,
            wall_time=0.0,
            samples=1.0,
            data_time=math.nan,
        )
        clock.mark_end(slot)
        guard.track(slot, row)
        flusher.rows += 1
        if flusher.due():
            block = flusher.flush()
            assert block is not None
            block.read()
        hits.append(guard.poll())
    assert hits[:10] == [None] * 10
    step, value = hits[10]  # type: ignore[misc]
    assert step == 6 and math.isnan(value)
    assert hits[11] is None


class _PerSlotClock(HostClock):
    """Answers end_done per slot, as CUDA events do: asking for a slot the ring lacks is an error."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.ended = np.zeros(capacity, dtype=bool)

    def mark_end(self, slot: int) -> None:
        super().mark_end(slot)
        self.ended[slot] = True

    def end_done(self, slot: int) -> bool:
        return bool(self.ended[slot])  # IndexError for anything but a slot


def test_guard_polls_the_end_mark_of_a_rows_slot_after_the_ring_wrapped() -> None:
    ring = _device_ring(capacity=4)
    clock = _PerSlotClock(4)
    flusher = Flusher(ring, clock, flush_every=2, flush_seconds=None)
    guard = LossGuard(ring, clock)
    hits = []
    for step in range(7):
        loss = math.inf if step == 5 else 0.5
        slot = _write(ring, flusher, step, loss)
        guard.track(slot, step)
        hits.append(guard.poll())
        if flusher.due():
            block = flusher.flush()
            assert block is not None
            block.read()
    assert hits == [None] * 5 + [(5, math.inf), None]  # step 5 lives in slot 1
