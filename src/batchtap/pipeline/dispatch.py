"""Fan records out to sinks, each on its own worker thread behind a bounded queue.

One worker per sink, so a slow or failing sink never holds up the others. A worker takes everything
queued at once and hands consecutive blocks to its sink as one ``write`` call, so a sink that costs
100 ms per call still keeps up with any step rate.

Backpressure, when a sink's queue is full:

* ``"block"`` (default): the pipeline thread waits for room, and a warning event says for how long.
  Nothing is lost; if the wait lasts, the training thread eventually waits for ring slots too.
* ``"drop_oldest"``: the oldest queued block is dropped to make room; every drop is counted and
  reported as a warning event.

Life-cycle items (run start/end, flush barriers) are never dropped and do not count against the
queue size.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

from batchtap.records import Event, EventKind, Record, RunInfo
from batchtap.sinks.base import Sink

__all__ = ["Backpressure", "Dispatcher", "SinkWorker"]

log = logging.getLogger("batchtap")

Backpressure = Literal["block", "drop_oldest"]


@dataclasses.dataclass(slots=True)
class _Write:
    records: list[Record]
    events: list[Event]


@dataclasses.dataclass(slots=True)
class _Call:
    name: Literal["start_run", "end_run", "flush"]
    run: RunInfo | None = None
    done: threading.Event | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Epoch:
    run_id: str
    epoch: int
    total: int | None


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
        self.maxsize = maxsize
        self.policy = policy
        self._warn = warn
        self._items: collections.deque[object] = collections.deque()
        self._writes = 0  # _Write items queued
        self._cv = threading.Condition()
        self.dropped_blocks = 0
        self.dropped_records = 0
        self.failures = 0
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
            self._items.append(_Write(records, events))
            self._writes += 1
            self._cv.notify_all()

    def put_call(self, call: _Call | object) -> None:
        with self._cv:
            self._items.append(call)
            self._cv.notify_all()

    def _drop_oldest(self) -> None:
        for i, item in enumerate(self._items):
            if isinstance(item, _Write):
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
                self._cv.notify_all()
            pending = _Write([], [])
            for item in batch:
                if isinstance(item, _Write):
                    pending.records.extend(item.records)
                    pending.events.extend(item.events)
                    continue
                self._write(pending)
                pending = _Write([], [])
                if item is _STOP:
                    self._guarded("close", self.sink.close)
                    return
                if isinstance(item, _Epoch):
                    start_epoch = getattr(self.sink, "start_epoch", None)  # sinks need not derive from Sink
                    if start_epoch is not None:
                        self._guarded("start_epoch", start_epoch, item.run_id, item.epoch, item.total)
                    continue
                assert isinstance(item, _Call)
                if item.name == "flush":
                    self._guarded("flush", self.sink.flush)
                    assert item.done is not None
                    item.done.set()
                else:
                    self._guarded(item.name, getattr(self.sink, item.name), item.run)
            self._write(pending)

    def _write(self, pending: _Write) -> None:
        if pending.records or pending.events:
            self._guarded("write", self.sink.write, pending.records, pending.events)

    def _guarded(self, what: str, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a sink must never take the pipeline down
            self.failures += 1
            log.warning("batchtap sink %s failed in %s: %r", self.name, what, exc)
            self._warn(f"sink {self.name} failed in {what}: {exc!r}")
        take_events = getattr(self.sink, "take_events", None)  # ResilientSink reports outages
        if take_events is not None:
            for event in take_events():
                self._warn(event.message)

    def stop(self, timeout: float | None = None) -> None:
        self.put_call(_STOP)
        self._thread.join(timeout)


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

    def start_run(self, run: RunInfo) -> None:
        self._run = run
        for w in self.workers:
            w.put_call(_Call("start_run", run))

    def write(self, records: list[Record], events: list[Event]) -> None:
        if records:
            self._last_step = records[-1].step
        events = self._take_warnings() + events
        for w in self.workers:
            w.put_write(records, events)

    def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
        for w in self.workers:
            w.put_call(_Epoch(run_id, epoch, total))

    def end_run(self, run: RunInfo) -> None:
        warnings = self._take_warnings()
        if warnings:
            for w in self.workers:
                w.put_write([], warnings)
        for w in self.workers:
            w.put_call(_Call("end_run", run))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every sink wrote and flushed everything queued so far; False on timeout."""
        barriers = []
        for w in self.workers:
            done = threading.Event()
            w.put_call(_Call("flush", done=done))
            barriers.append(done)
        deadline = None if timeout is None else time.monotonic() + timeout
        for done in barriers:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not done.wait(remaining):
                return False
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        for w in self.workers:
            w.stop(timeout)

    def _take_warnings(self) -> list[Event]:
        out = []
        while self._warnings:
            message = self._warnings.popleft()
            run_id = self._run.id if self._run else ""
            out.append(Event(run_id, self._last_step, EventKind.WARNING, message, time.time()))
        return out
