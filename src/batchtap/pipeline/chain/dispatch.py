"""Fan records out to sinks, each on its own worker thread behind a bounded queue.

One worker per sink, so a slow or failing sink never holds up the others. A worker takes everything
queued at once and hands consecutive blocks to its sink as one ``write`` call, so a sink that costs
100 ms per call still keeps up with any step rate.

Backpressure, when a sink's queue is full:

* ``"block"`` (default): the pipeline thread waits for room, and a warning event says for how long.
  Nothing is lost; if the wait lasts, the training thread eventually waits for ring slots too.
* ``"drop_oldest"``: the oldest queued block is dropped to make room; every drop is counted and
  reported as a warning event.

Life-cycle items (run start/end, flush barriers) and the end-of-run reports are never dropped and
do not count against the queue size. Every drop is also summed per sink and run, and the sum is
reported when the run ends (an event to every sink, where it cannot be dropped, and a log warning),
so a sink that dropped its own drop reports still has the count stored.

A sink that does not keep up within a deadline (:meth:`Dispatcher.flush` with a timeout) is
reported with exactly what it had not yet taken (:meth:`Dispatcher.undelivered`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

from batchtap.records import EpochStart, Event, EventKind, Record, RunEnd, RunInfo, RunStart, Write
from batchtap.sinks.base import Sink

__all__ = ["Backpressure", "Dispatcher", "SinkWorker"]

log = logging.getLogger("batchtap")

Backpressure = Literal["block", "drop_oldest"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Report(Write):
    """A write that is never dropped (warnings and end-of-run reports)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Flushed:
    """A flush barrier: the worker flushes its sink, then sets ``done``."""

    done: threading.Event


#: what a worker's queue holds: the sink calls as values (see :mod:`batchtap.records`), barriers
_Item = Write | RunStart | RunEnd | EpochStart | _Flushed | object

_STOP = object()


class SinkWorker:
    """One sink, its bounded queue and the thread that drains it.

    Args:
        sink: the sink to drive.
        maxsize: queued write blocks before backpressure applies.
        policy: what to do when the queue is full.
        warn: called (from any thread) with a message when the worker degrades: a block, a drop, a
            sink exception. The dispatcher turns these into warning events.
    """

    def __init__(self, sink: Sink, *, maxsize: int, policy: Backpressure, warn: Callable[[str], None]) -> None:
        self.sink = sink
        # The optional hooks come from the Sink base class; an object that only has write/flush/close
        # (allowed here, not by the Tap) gets none of them.
        self._start_epoch = sink.start_epoch if isinstance(sink, Sink) else None
        self._take_events = sink.take_events if isinstance(sink, Sink) else list
        self.maxsize = maxsize
        self.policy = policy
        self._warn = warn
        self.late: collections.deque[tuple[str, str]] = collections.deque()  #: (run id, message) from end_run
        self._ending: str | None = None
        self._items: collections.deque[_Item] = collections.deque()
        self._writes = 0  # droppable writes queued
        self._cv = threading.Condition()
        self.dropped_blocks = 0
        self.dropped_records = 0
        self.failures = 0
        #: records handed to the sink in write() calls that raised (not stored by it, unless it
        #: is a ResilientSink, which never raises for a failing sink)
        self.failed_records = 0
        self._current: list[_Item] = []  # the batch being worked through ...
        self._pos = 0  # ... and the index of the item in progress
        self.name = type(sink).__name__
        self._thread = threading.Thread(target=self._loop, name=f"batchtap-sink-{self.name}", daemon=True)
        self._thread.start()

    def put_write(self, records: list[Record], events: list[Event]) -> None:
        with self._cv:
            if self._writes >= self.maxsize:
                if self.policy == "drop_oldest":
                    self._drop_oldest()
                else:
                    started = time.monotonic()
                    self._cv.wait_for(lambda: self._writes < self.maxsize)
                    self._warn(
                        f"sink {self.name} queue was full ({self.maxsize} blocks); the pipeline blocked "
                        f"{time.monotonic() - started:.3f} s waiting for it"
                    )
            self._items.append(Write(records, events))
            self._writes += 1
            self._cv.notify_all()

    def put_call(self, call: _Item) -> None:
        """Queue a call that is never dropped and never waits for room."""
        with self._cv:
            self._items.append(call)
            self._cv.notify_all()

    def put_report(self, events: list[Event]) -> None:
        """Queue events that must reach the sink: never dropped, never waiting for room."""
        self.put_call(_Report([], events))

    def undelivered(self) -> tuple[int, int, int | None, int | None]:
        """What the sink has not taken yet: (blocks, records, first step, last step)."""
        with self._cv:
            items = self._current[self._pos :] + list(self._items)
        writes = [i for i in items if isinstance(i, Write) and i.records]
        steps = [r.step for w in writes for r in w.records]
        return len(writes), len(steps), (min(steps) if steps else None), (max(steps) if steps else None)

    def _drop_oldest(self) -> None:
        for i, item in enumerate(self._items):
            if isinstance(item, Write) and not isinstance(item, _Report):
                del self._items[i]
                self._writes -= 1
                self.dropped_blocks += 1
                self.dropped_records += len(item.records)
                self._warn(
                    f"sink {self.name} queue was full ({self.maxsize} blocks); dropped the oldest block "
                    f"(steps {item.records[0].step if item.records else '-'}.."
                    f"{item.records[-1].step if item.records else '-'}, {len(item.records)} records; "
                    f"{self.dropped_records} dropped in all)"
                )
                return

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._items))
                batch = list(self._items)
                self._items.clear()
                self._writes = 0
                self._current, self._pos = batch, 0
                self._cv.notify_all()
            records: list[Record] = []
            events: list[Event] = []
            start = 0  # index in batch of the first write merged into records/events
            for index, item in enumerate(batch):
                if isinstance(item, Write):
                    if not records and not events:
                        start = index
                    records.extend(item.records)
                    events.extend(item.events)
                    continue
                self._pos = start if (records or events) else index
                self._write(records, events)
                self._pos = index
                records, events = [], []
                if item is _STOP:
                    self._guarded("close", self.sink.close)
                    return
                self._call(item)
            if records or events:
                self._pos = start
            self._write(records, events)
            with self._cv:
                self._current, self._pos = [], 0

    def _call(self, item: _Item) -> None:
        if isinstance(item, RunStart):
            self._guarded("start_run", self.sink.start_run, item.run)
        elif isinstance(item, RunEnd):
            # what a sink says in end_run (a webhook's failed final alert) comes after the run's last
            # block: kept apart with the run's id and handed to the other sinks at close
            self._ending = item.run.id
            try:
                self._guarded("end_run", self.sink.end_run, item.run)
            finally:
                self._ending = None
        elif isinstance(item, EpochStart):
            if self._start_epoch is not None:
                self._guarded("start_epoch", self._start_epoch, item.run_id, item.epoch, item.total)
        else:
            assert isinstance(item, _Flushed)
            self._guarded("flush", self.sink.flush)
            item.done.set()

    def _write(self, records: list[Record], events: list[Event]) -> None:
        if records or events:
            if not self._guarded("write", self.sink.write, records, events):
                self.failed_records += len(records)

    def _guarded(self, what: str, fn: Callable[..., None], *args: object) -> bool:
        ok = True
        try:
            fn(*args)
        except Exception as exc:  # a sink must never take the pipeline down
            ok = False
            self.failures += 1
            lost = ""
            if what == "write" and args and isinstance(args[0], list) and args[0]:
                records: list[Record] = args[0]
                lost = f"; {len(records)} records of steps {records[0].step}..{records[-1].step} were not stored by it"
            log.warning("batchtap sink %s failed in %s: %r%s", self.name, what, exc, lost)
            self._say(f"sink {self.name} failed in {what}: {exc!r}{lost}")
        for event in self._take_events():  # e.g. a ResilientSink's outage, a SQL sink's refused rows
            self._say(event.message)
        return ok

    def _say(self, message: str) -> None:
        if self._ending is not None:
            self.late.append((self._ending, message))
        else:
            self._warn(message)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to end (after a stop); False if it had not within ``timeout``."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class Dispatcher:
    """Sends every block, run start/end and flush to all sinks through their workers."""

    def __init__(self, sinks: Sequence[Sink], *, maxsize: int = 64, policy: Backpressure = "block") -> None:
        if policy not in ("block", "drop_oldest"):
            from batchtap.errors import ConfigError

            raise ConfigError(f"backpressure must be 'block' or 'drop_oldest', got {policy!r}")
        self._warnings: collections.deque[str] = collections.deque()
        self.workers = [SinkWorker(s, maxsize=maxsize, policy=policy, warn=self._warnings.append) for s in sinks]
        self._run: RunInfo | None = None
        self._last_step = 0
        #: (dropped blocks, dropped records, failed records) of each worker when the run started
        self._baseline: list[tuple[int, int, int]] = []
        #: the workers whose last flush barrier was not passed in time
        self.stuck: list[SinkWorker] = []

    def start_run(self, run: RunInfo) -> None:
        self._run = run
        self._baseline = [(w.dropped_blocks, w.dropped_records, w.failed_records) for w in self.workers]
        for w in self.workers:
            w.put_call(RunStart(run))

    def write(self, records: list[Record], events: list[Event]) -> None:
        if records:
            self._last_step = records[-1].step
        events = self._take_warnings() + events
        for w in self.workers:
            w.put_write(records, events)

    def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
        for w in self.workers:
            w.put_call(EpochStart(run_id, epoch, total))

    def end_run(self, run: RunInfo) -> None:
        warnings = self._take_warnings()
        if warnings:
            for w in self.workers:
                w.put_report(warnings)
        for w in self.workers:
            w.put_call(RunEnd(run))

    def loss_report(self, run: RunInfo) -> list[Event]:
        """One event per sink that dropped or failed to store records in this run so far, with the
        exact counts (the per-drop warnings may themselves have been dropped); logged as well.
        Call it once the run's last flush barrier was passed."""
        out = []
        base = self._baseline or [(0, 0, 0)] * len(self.workers)
        for w, (blocks0, records0, failed0) in zip(self.workers, base):
            blocks, records, failed = (
                w.dropped_blocks - blocks0,
                w.dropped_records - records0,
                w.failed_records - failed0,
            )
            parts = []
            if blocks:
                parts.append(f"dropped {blocks} blocks ({records} records) under backpressure='drop_oldest'")
            if failed:
                parts.append(f"failed to store {failed} records (its write() raised)")
            if parts:
                message = f"run {run.name!r}: sink {w.name} {' and '.join(parts)}; those steps are missing from it"
                log.warning("batchtap: %s", message)
                out.append(Event(run.id, self._last_step, EventKind.WARNING, message, time.time()))
        return out

    def undelivered(self) -> list[tuple[str, int, int, int | None, int | None]]:
        """For each sink stuck at the last flush: (name, blocks, records, first step, last step)
        it has not taken yet."""
        return [(w.name, *w.undelivered()) for w in self.stuck]

    def report(self, events: list[Event]) -> None:
        """Queue events for every sink not stuck at the last flush, never dropped."""
        for w in self.workers:
            if w not in self.stuck:
                w.put_report(events)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every sink wrote and flushed everything queued so far; False on timeout."""
        barriers = []
        for w in self.workers:
            done = threading.Event()
            w.put_call(_Flushed(done))
            barriers.append(done)
        deadline = None if timeout is None else time.monotonic() + timeout
        self.stuck = []
        for w, done in zip(self.workers, barriers):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not done.wait(remaining):
                self.stuck.append(w)
        return not self.stuck

    def close(self, timeout: float | None = 30.0) -> None:
        """Close every sink, waiting at most ``timeout`` seconds in all (a hung sink is left to its
        daemon thread and reported)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._run is not None:
            # A sink can fail in end_run (a webhook's final alert) after the run's last block: let every
            # sink finish what it was given, then hand what they said there to the others before they close.
            # sync: close — bounded by half the close's timeout; a sink already stuck at the last flush is
            # not waited for (its own close still gets the rest of the timeout below).
            late_wait = None if timeout is None else timeout / 2
            barriers = []
            for w in self.workers:
                if w not in self.stuck:
                    done = threading.Event()
                    w.put_call(_Flushed(done))
                    barriers.append(done)
            until = None if late_wait is None else time.monotonic() + late_wait
            for done in barriers:
                if not done.wait(None if until is None else max(0.0, until - time.monotonic())):
                    break
            late = []
            for w in self.workers:
                while w.late:
                    run_id, message = w.late.popleft()
                    late.append(Event(run_id, self._last_step, EventKind.WARNING, message, time.time()))
            if late:
                self.report(late)
        for w in self.workers:
            w.put_call(_STOP)
        for w in self.workers:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not w.join(remaining):
                blocks, records, first, last = w.undelivered()
                log.warning(
                    "batchtap: sink %s did not close within %s s; %d blocks (%d records, steps %s..%s) were "
                    "not handed to it",
                    w.name,
                    timeout,
                    blocks,
                    records,
                    first,
                    last,
                )

    def _take_warnings(self) -> list[Event]:
        out = []
        while self._warnings:
            message = self._warnings.popleft()
            run_id = self._run.id if self._run else ""
            out.append(Event(run_id, self._last_step, EventKind.WARNING, message, time.time()))
        return out
