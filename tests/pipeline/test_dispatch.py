"""Sink workers: coalescing, isolation of a failing or slow sink, explicit backpressure."""

from __future__ import annotations

import threading
import time

import torch

import batchtap as bt
from batchtap.pipeline.chain.dispatch import Dispatcher
from batchtap.records import EventKind, Record
from tests.conftest import ListSink


def _records(first: int, n: int) -> list[Record]:
    return [Record("r", s, 0, s, 0, 0.0, {"loss": float(s)}) for s in range(first, first + n)]


class GatedSink(ListSink):
    """Blocks every write until the test opens the gate; ``entered`` says a write is waiting there."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, records, events=()):
        self.entered.set()
        self.gate.wait()
        super().write(records, events)


class FailingSink(ListSink):
    def write(self, records, events=()):
        raise OSError("disk full")


class SlowSink(ListSink):
    def write(self, records, events=()):
        time.sleep(0.1)
        super().write(records, events)


def test_drop_oldest_counts_and_reports_every_drop() -> None:
    gated = GatedSink()
    d = Dispatcher([gated], maxsize=2, policy="drop_oldest")
    d.write(_records(0, 5), [])
    assert gated.entered.wait(10)  # the worker took block 0 and is now stuck in write()
    for i in range(1, 6):
        d.write(_records(5 * i, 5), [])
    gated.gate.set()
    d.flush(timeout=10)
    worker = d.workers[0]
    assert worker.dropped_blocks == 3 and worker.dropped_records == 15
    kept = [r.step for r in gated.records]
    assert kept == list(range(0, 5)) + list(range(20, 30))  # the oldest queued blocks went
    d.write([], [])
    d.flush(timeout=10)
    drops = [e for e in gated.events if e.kind is EventKind.WARNING and "dropped the oldest block" in e.message]
    assert len(drops) == 3
    d.close()


def test_block_policy_waits_loses_nothing_and_warns() -> None:
    gated = GatedSink()
    d = Dispatcher([gated], maxsize=1, policy="block")
    d.write(_records(0, 1), [])
    assert gated.entered.wait(10)  # the worker holds block 0 inside write()
    d.write(_records(1, 1), [])  # fills the queue
    done = threading.Event()

    def third() -> None:
        d.write(_records(2, 1), [])
        done.set()

    threading.Thread(target=third, daemon=True).start()
    assert not done.wait(0.2)  # blocked while the sink is stuck
    gated.gate.set()
    assert done.wait(5)
    d.write([], [])
    d.flush(timeout=10)
    assert [r.step for r in gated.records] == [0, 1, 2]
    assert any("blocked" in e.message for e in gated.events if e.kind is EventKind.WARNING)
    d.close()


def test_a_failing_sink_does_not_stop_training_or_the_other_sinks() -> None:
    good = ListSink()
    with bt.Tap([bt.metrics.Loss()], [FailingSink(), good], flush_every=2) as tap, tap.run():
        for i in range(11):
            tap.step(loss=torch.tensor(float(i)))
    assert [r.values["loss"] for r in good.records] == [float(i) for i in range(11)]
    assert any("disk full" in e.message for e in good.events if e.kind is EventKind.WARNING)


def test_a_slow_sink_gets_coalesced_blocks_and_keeps_up() -> None:
    slow = SlowSink()
    with bt.Tap([bt.metrics.Loss()], [slow], flush_every=1, capacity=2) as tap, tap.run():
        for i in range(300):
            tap.step(loss=torch.tensor(float(i)))
    assert [r.step for r in slow.records] == list(range(300))
    assert slow.writes < 300 / 5  # many flushed blocks per write call


def test_start_epoch_reaches_every_sink_in_order_with_the_blocks() -> None:
    """``Dispatcher.start_epoch`` travels the workers' queues like a block: a sink sees it between
    the blocks written before and after it; a sink without the hook is skipped."""
    from batchtap.sinks.base import Sink

    class Seen(Sink):
        def __init__(self) -> None:
            self.log: list[object] = []

        def write(self, records, events=()):  # type: ignore[no-untyped-def]
            self.log.extend(r.step for r in records)

        def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
            self.log.append((run_id, epoch, total))

    class Bare:
        def __init__(self) -> None:
            self.n = 0

        def write(self, records, events=()):  # type: ignore[no-untyped-def]
            self.n += len(records)

        def flush(self) -> None:
            pass

        def close(self) -> None:
            pass

    seen, bare = Seen(), Bare()
    d = Dispatcher([seen, bare])  # type: ignore[list-item]
    rec = [Record("r", s, 0, s, 0, 0.0, {"loss": 1.0}) for s in range(4)]
    d.write(rec[:2], [])
    d.start_epoch("r", 1, 12)
    d.write(rec[2:], [])
    assert d.flush(timeout=30)
    d.close()
    assert seen.log == [0, 1, ("r", 1, 12), 2, 3] and bare.n == 4


def test_close_delivers_blocks_still_queued_without_a_flush() -> None:
    gated = GatedSink()
    d = Dispatcher([gated], maxsize=16)
    d.write(_records(0, 3), [])
    assert gated.entered.wait(10)  # the worker is stuck writing block 0; the rest stays queued
    for i in range(1, 5):
        d.write(_records(3 * i, 3), [])
    worker = d.workers[0]
    closer = threading.Thread(target=d.close)
    closer.start()
    with worker._cv:  # close() has queued its stop behind the four blocks (no flush anywhere)
        assert worker._cv.wait_for(lambda: len(worker._items) == 5, timeout=10)
    gated.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert [r.step for r in gated.records] == list(range(15))
    assert gated.closed and gated.writes == 2  # the four queued blocks went in one call, then close


def test_warnings_raised_after_the_last_block_still_reach_the_sinks_at_run_end() -> None:
    from batchtap.records import RunInfo

    good = ListSink()
    d = Dispatcher([FailingSink(), good])
    run = RunInfo(id="r", name="r", config={}, started_at=0.0)
    d.start_run(run)
    d.write(_records(0, 2), [])
    assert d.flush(timeout=10)  # the failing sink's worker has raised and queued its warning by now
    assert not any("disk full" in e.message for e in good.events)  # nothing carried it yet
    d.end_run(run)
    assert d.flush(timeout=10)
    d.close()
    (warning,) = [e for e in good.events if "disk full" in e.message]
    assert warning.kind is EventKind.WARNING and warning.run_id == "r" and warning.step == 1
    assert good.ended == [run]
