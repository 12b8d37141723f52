"""The pipeline thread: read flushed blocks back, decode, validate, run hooks, dispatch to sinks.

Everything the training thread hands over goes through one FIFO queue, so sinks see a run's start,
its blocks and its end in order. The training thread never waits for this thread except in
:meth:`Harvester.drain` (end of run, explicit flush) and when the ring is full (see ``Flusher``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from batchtap.capture.clock import DeviceGate
from batchtap.capture.flush import Block, Flusher
from batchtap.capture.logged import Logged
from batchtap.pipeline.decode import Decoded, Decoder
from batchtap.pipeline.dispatch import Dispatcher
from batchtap.pipeline.reduce import Reducer
from batchtap.records import Event, Record, RunInfo

__all__ = ["Harvester", "RunPipeline"]

log = logging.getLogger("batchtap")

#: Called on the pipeline thread with each decoded block; may append events (rules do).
BlockHook = Callable[[Decoded], None]


@dataclasses.dataclass(slots=True)
class RunPipeline:
    """What the pipeline does with one run's blocks.

    Attributes:
        decoder: rows -> validated records of this rank.
        reducer: combines the ranks' records (None outside a process group).
        writes: whether this process hands records to its sinks (rank 0 by default).
        pending_events: training-thread events held back to travel with the next block through the
            reducer, so the writing rank stores every rank's events.
    """

    decoder: Decoder
    reducer: Reducer | None = None
    writes: bool = True
    pending_events: list[Event] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class _LoggedItem:
    logged: Logged
    run_id: str
    rank: int
    writes: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _BlockItem:
    flusher: Flusher
    block: Block
    run: RunPipeline


class Harvester:
    """Owns the pipeline thread.

    Args:
        dispatcher: where decoded blocks go.
        on_block: hooks run on each decoded block before dispatch (anomaly bookkeeping, rules).
        on_error: called with an exception raised inside the pipeline (it is re-raised on the
            training thread at its next step).
    """

    def __init__(self, dispatcher: Dispatcher, *, on_block: list[BlockHook], on_error: Callable[[BaseException], None]) -> None:
        self.dispatcher = dispatcher
        self.on_block = on_block
        self.on_error = on_error
        self.gate = DeviceGate()  # the training thread pauses it around CUDA graph captures
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="batchtap-pipeline", daemon=True)
        self._thread.start()

    def submit(self, flusher: Flusher, block: Block, run: RunPipeline) -> None:
        self._queue.put(_BlockItem(flusher, block, run))

    def events(self, events: list[Event], run: RunPipeline | None = None) -> None:
        """Hand over events raised on the training thread (through ``run``'s reducer when it has one)."""
        self._queue.put(("events", (events, run)))

    def logged(self, logged: Logged, *, run_id: str, rank: int, writes: bool) -> None:
        """Hand over values from ``Tap.log()``: stored as sparse records once their copy completed."""
        self._queue.put(_LoggedItem(logged, run_id, rank, writes))

    def start_run(self, run: RunInfo, *, writes: bool = True) -> None:
        if writes:
            self._queue.put(("start_run", run))

    def end_run(self, run: RunInfo, *, writes: bool = True) -> None:
        if writes:
            self._queue.put(("end_run", run))

    def start_epoch(self, run_id: str, epoch: int, total: int | None, *, writes: bool = True) -> None:
        """An epoch of ``total`` batches began (for the sinks' progress displays)."""
        if writes:
            self._queue.put(("start_epoch", (run_id, epoch, total)))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far was decoded and handed to the sinks.

        Returns False when ``timeout`` seconds passed first (the pipeline is stuck or gone).
        """
        done = threading.Event()
        self._queue.put(("barrier", done))
        if not self._thread.is_alive():
            return False
        # sync: end of run / explicit flush — the caller asked for everything captured so far.
        return done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._handle(item)
            except BaseException as exc:  # keep the thread alive; the training thread re-raises
                log.exception("batchtap pipeline failed")
                self.on_error(exc)

    def _handle(self, item: object) -> None:
        if isinstance(item, _BlockItem):
            try:
                data = item.flusher.read(item.block, self.gate)
            finally:
                item.flusher.release(item.block)  # even on failure, or the training thread would wait forever
            run = item.run
            decoded = run.decoder.decode(data)
            if run.pending_events:
                decoded.events[:0], run.pending_events = run.pending_events, []
            if run.reducer is not None:
                decoded = run.reducer.reduce(decoded, data.samples, data.step_time)
            for hook in self.on_block:
                hook(decoded)
            if run.writes:
                self.dispatcher.write(decoded.records, decoded.events)
            return
        if isinstance(item, _LoggedItem):
            logged = item.logged
            while True:
                with self.gate.querying():
                    if logged.done():
                        break
                time.sleep(2e-4)  # like a block's marker: polled, never a blocking wait on the device
            if item.writes:
                record = Record(
                    item.run_id, logged.step, logged.epoch, -1, item.rank, logged.wall_time, logged.values(), sparse=True
                )
                self.dispatcher.write([record], [])
            return
        assert isinstance(item, tuple)
        kind: str = item[0]
        payload: Any = item[1]
        if kind == "events":
            events, run_pipeline = payload
            if run_pipeline is not None and run_pipeline.reducer is not None and not run_pipeline.reducer.broken:
                run_pipeline.pending_events.extend(events)
            elif run_pipeline is None or run_pipeline.writes:
                self.dispatcher.write([], events)
        elif kind == "start_run":
            self.dispatcher.start_run(payload)
        elif kind == "end_run":
            self.dispatcher.end_run(payload)
        elif kind == "start_epoch":
            self.dispatcher.start_epoch(*payload)
        elif kind == "barrier":
            payload.set()
