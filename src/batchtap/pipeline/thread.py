"""The pipeline on a thread of the training process (``Tap(pipeline="thread")``).

Everything the training thread hands over goes through one FIFO queue, so sinks see a run's start,
its blocks and its end in order. The thread reads each block back (:func:`read_block`), runs the
run's :class:`~batchtap.pipeline.chain.RunChain`, posts the rules' verdict to the
:class:`~batchtap.pipeline.control.Control` and hands records and events to the sink workers
(:class:`~batchtap.pipeline.dispatch.Dispatcher`). The training thread never waits for it except in
:meth:`ThreadPipeline.drain` (run start and end, explicit flush) and when the ring is full.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from batchtap.capture.clock import DeviceGate
from batchtap.capture.flush import Block, BlockData, Flusher
from batchtap.capture.logged import Logged
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain import ReduceSpec, RunChain
from batchtap.pipeline.control import Control
from batchtap.pipeline.core import PipelineCore, PipelineSettings
from batchtap.pipeline.harvest import read_block
from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.base import Sink

__all__ = ["ThreadPipeline"]

log = logging.getLogger("batchtap")


@dataclasses.dataclass(frozen=True, slots=True)
class _Logged:
    logged: Logged
    run_id: str
    rank: int
    writes: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Block:
    flusher: Flusher
    block: Block
    chain: RunChain
    logged: tuple[Logged, ...]


class ThreadPipeline:
    """Owns the pipeline thread and, through its :class:`PipelineCore`, the sink workers.

    Args:
        sinks: where records go.
        control: where verdicts and errors go (read by the training thread).
        settings: queues, backpressure and rules.
    """

    def __init__(self, sinks: Sequence[Sink], control: Control, settings: PipelineSettings | None = None) -> None:
        self.core = PipelineCore(sinks, control, settings)
        self.sinks = self.core.sinks
        self.gate = DeviceGate()  # the training thread pauses it around CUDA graph captures
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="batchtap-pipeline", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread

    def open_chain(
        self, layout: Layout, *, run_id: str, rank: int, writes: bool, reduce: ReduceSpec | None, max_rows: int = 0
    ) -> RunChain:
        """The chain of a run whose capture was just made."""
        return self.core.open_chain(layout, run_id=run_id, rank=rank, writes=writes, reduce=reduce)

    def submit(self, flusher: Flusher, block: Block, chain: RunChain, logged: Sequence[Logged] = ()) -> None:
        """Hand over a flushed block, with the ``log()`` values logged during its steps (stored
        together with its rows)."""
        self._queue.put(_Block(flusher, block, chain, tuple(logged)))

    def submit_data(self, data: BlockData, chain: RunChain, logged: Sequence[Record] = ()) -> None:
        """A block already read back (the process pipeline's fallback hands its segment over)."""
        self._queue.put(("data", (data, chain, list(logged))))

    def events(self, events: list[Event], chain: RunChain | None = None, *, writes: bool = True) -> None:
        """Hand over events raised on the training side (through ``chain``'s reducer when it has one)."""
        if events:
            self._queue.put(("events", (events, chain, writes)))

    def logged(self, logged: Logged, *, run_id: str, rank: int, writes: bool) -> None:
        """Hand over values from ``Tap.log()``: stored as sparse records once their copy completed."""
        self._queue.put(_Logged(logged, run_id, rank, writes))

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

    def ranks_failed(self, chain: RunChain, reason: str) -> None:
        """The ranks' agreement failed: the chain stops exchanging (in order with the blocks)."""
        self._queue.put(("ranks_failed", (chain, reason)))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far was processed and handed to the sinks.

        Returns False when ``timeout`` seconds passed first (the pipeline is stuck or gone).
        """
        done = threading.Event()
        self._queue.put(("barrier", done))
        if not self._thread.is_alive():
            return False
        # sync: run start/end, explicit flush — the caller asked for everything captured so far.
        return done.wait(timeout)

    def flush_sinks(self, timeout: float | None = None) -> bool:
        return self.core.flush_sinks(timeout)

    def finish_run(self, info: RunInfo, *, timeout: float, last_step: int) -> bool:
        """Wait (bounded) until every step of the run is stored; report what is missing."""
        return self.core.finish_run(self, info, timeout=timeout, last_step=last_step)

    def stored_position(self, run_id: str) -> tuple[list[int], list[str]]:
        return self.core.stored_position(run_id)

    def at_exit(self, timeout: float) -> None:
        """Interpreter exit: nothing to do (the thread and sink workers are daemons)."""

    def close(self, timeout: float | None = 30.0) -> None:
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

    def _handle(self, item: object) -> None:
        core = self.core
        if isinstance(item, _Block):
            data, chain = read_block(item.flusher, item.block, self.gate), item.chain
            for logged in item.logged:
                wait_for_copy(logged, self.gate)
            core.block(data, chain, [logged.record(chain.run_id, chain.rank) for logged in item.logged])
            return
        if isinstance(item, _Logged):
            wait_for_copy(item.logged, self.gate)
            core.sparse(item.logged.record(item.run_id, item.rank), writes=item.writes)
            return
        assert isinstance(item, tuple)
        kind: str = item[0]
        payload: Any = item[1]
        if kind == "data":
            core.block(*payload)
        elif kind == "events":
            core.events(*payload)
        elif kind == "start_run":
            core.start_run(payload)
        elif kind == "end_run":
            core.end_run(payload)
        elif kind == "start_epoch":
            core.start_epoch(*payload)
        elif kind == "ranks_failed":
            payload[0].ranks_failed(payload[1])
        elif kind == "barrier":
            payload.set()


def wait_for_copy(logged: Logged, gate: DeviceGate) -> None:
    """Poll (never block on) the device until ``logged``'s values reached the host."""
    while True:
        with gate.querying():
            if logged.done():
                return
        time.sleep(2e-4)  # like a block's marker: polled, never a blocking wait on the device
