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
from collections.abc import Callable

from batchtap.capture.flush import Block, Flusher
from batchtap.pipeline.decode import Decoded, Decoder
from batchtap.pipeline.dispatch import Dispatcher
from batchtap.records import Event, RunInfo

__all__ = ["Harvester"]

log = logging.getLogger("batchtap")

#: Called on the pipeline thread with each decoded block; may append events (rules do).
BlockHook = Callable[[Decoded], None]


@dataclasses.dataclass(frozen=True, slots=True)
class _BlockItem:
    flusher: Flusher
    block: Block
    decoder: Decoder


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
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="batchtap-pipeline", daemon=True)
        self._thread.start()

    def submit(self, flusher: Flusher, block: Block, decoder: Decoder) -> None:
        self._queue.put(_BlockItem(flusher, block, decoder))

    def events(self, events: list[Event]) -> None:
        self._queue.put(("events", events))

    def start_run(self, run: RunInfo) -> None:
        self._queue.put(("start_run", run))

    def end_run(self, run: RunInfo) -> None:
        self._queue.put(("end_run", run))

    def drain(self) -> None:
        """Wait until everything submitted so far was decoded and handed to the sinks."""
        done = threading.Event()
        self._queue.put(("barrier", done))
        # sync: end of run / explicit flush — the caller asked for everything captured so far.
        done.wait()

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
                data = item.flusher.read(item.block)
            finally:
                item.flusher.release(item.block)  # even on failure, or the training thread would wait forever
            decoded = item.decoder.decode(data)
            for hook in self.on_block:
                hook(decoded)
            self.dispatcher.write(decoded.records, decoded.events)
            return
        kind, payload = item  # type: ignore[misc]
        if kind == "events":
            self.dispatcher.write([], payload)
        elif kind == "start_run":
            self.dispatcher.start_run(payload)
        elif kind == "end_run":
            self.dispatcher.end_run(payload)
        elif kind == "barrier":
            payload.set()
