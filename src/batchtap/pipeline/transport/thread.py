"""The pipeline on a thread of the training process (``Tap(pipeline="thread")``).

Everything the training thread hands over goes through one FIFO queue, so sinks see a run's start,
its blocks and its end in order. The thread reads each block back once its copy completed
(:meth:`~batchtap.capture.flush.Block.read`) and hands every message to its
:class:`~batchtap.pipeline.chain.core.PipelineCore`. The training thread never waits for it except in
:meth:`ThreadPipeline.drain` (run start and end, explicit flush), when the ring is full, and at a
block's hand-over while the block before it is still unjudged (a pipeline a whole flush behind:
:meth:`~batchtap.pipeline.chain.control.Control.hand_block`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from batchtap.capture.clock import DeviceGate
from batchtap.capture.flush import Block, wait_until
from batchtap.capture.logged import Logged
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.core import PipelineCore, PipelineSettings
from batchtap.pipeline.chain.messages import (
    Barrier,
    BlockRows,
    Close,
    FinishRun,
    Handover,
    LoggedValues,
    OpenChain,
    Request,
)
from batchtap.pipeline.transport.host import PipelineHost
from batchtap.sinks.base import Sink

__all__ = ["ThreadPipeline"]

log = logging.getLogger("batchtap")


@dataclasses.dataclass(frozen=True, slots=True)
class _Unread:
    """A flushed block (and its ``log()`` values) whose device copies may still be running."""

    block: Block
    chain: int
    logged: tuple[Logged, ...]
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class _UnreadLogged:
    """``log()`` values outside a block whose device copy may still be running."""

    logged: Logged
    run_id: str
    rank: int
    writes: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Passed:
    """A barrier: set once everything queued before it was handled."""

    done: threading.Event


class ThreadPipeline(PipelineHost):
    """Owns the pipeline thread and, through its :class:`PipelineCore`, the sink workers.

    Args:
        sinks: where records go.
        control: where verdicts and errors go (read by the training thread).
        settings: queues, backpressure and rules.
        gate: the device gate to query inside (a process pipeline that falls back to a thread
            passes its own, which the Tap pauses).
    """

    def __init__(
        self,
        sinks: Sequence[Sink],
        control: Control,
        settings: PipelineSettings | None = None,
        *,
        gate: DeviceGate | None = None,
    ) -> None:
        self.core = PipelineCore(sinks, control, settings)
        self.control = control
        self.sinks = self.core.sinks
        self.gate = gate or DeviceGate()  # the training thread pauses it around CUDA graph captures
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="batchtap-pipeline", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread

    def send(self, message: Handover) -> None:
        self._queue.put(self.numbered(message))

    def open(self, message: OpenChain, *, max_rows: int) -> None:
        self._queue.put(message)

    def submit(self, block: Block, chain: int, logged: Sequence[Logged] = (), *, index: int | None = None) -> None:
        if index is None:
            index = self.number_block(chain)
        self._queue.put(_Unread(block, chain, tuple(logged), index))

    def logged(self, logged: Logged, *, run_id: str, rank: int, writes: bool) -> None:
        self._queue.put(_UnreadLogged(logged, run_id, rank, writes))

    def ask(self, request: Request, timeout: float | None) -> Any:
        """Barriers go through the queue; the other requests are the core's own waits, made on the
        calling thread (the finish drains the queue first, bounded, and reports what is stuck)."""
        if isinstance(request, Barrier):
            passed = _Passed(threading.Event())
            self._queue.put(passed)
            if not self._thread.is_alive():
                return False
            # sync: run start/end, explicit flush — the caller asked for everything captured so far.
            return passed.done.wait(timeout)
        if isinstance(request, FinishRun):
            return self.core.finish_run(request, drain=self.drain)
        if isinstance(request, Close):
            self.close(request.timeout)
            return True
        return self.core.handle(request)

    def close(self, timeout: float | None = 30.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30)
        self.core.close(timeout=timeout)

    # ------------------------------------------------------------------ pipeline thread

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._handle(item)
            except BaseException as exc:  # keep the thread alive; the training thread re-raises
                log.exception("batchtap pipeline failed")
                self.core.control.fail(RuntimeError(f"batchtap pipeline failed: {exc!r}"))

    def _handle(self, item: Any) -> None:
        """One queued item: the device copies it waits for first, then the core's handling."""
        if isinstance(item, _Unread):
            data = item.block.read(self.gate)
            for logged in item.logged:
                wait_until(logged.done, self.gate)
            chain = self.core.chains[item.chain]  # opened: its OpenChain was queued before
            records = tuple(logged.record(chain.run_id, chain.rank) for logged in item.logged)
            self.core.handle(BlockRows(item.chain, data, records, item.index))
        elif isinstance(item, _UnreadLogged):
            wait_until(item.logged.done, self.gate)
            self.core.handle(LoggedValues(item.logged.record(item.run_id, item.rank), item.writes))
        elif isinstance(item, _Passed):
            item.done.set()
        else:
            self.core.handle(item)
