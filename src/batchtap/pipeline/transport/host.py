"""What the ``Tap`` asks of a pipeline, wherever it runs, and how one is made.

A host is the training thread's side of a pipeline. Every call turns into a message of
:mod:`batchtap.pipeline.chain.messages`: :meth:`PipelineHost.send` hands one over (never waits),
:meth:`PipelineHost.ask` hands a request over and waits (bounded) for its answer. A flushed block
and ``log()`` values wait for their device copies first, which only the host knows how to do
(:meth:`PipelineHost.submit`, :meth:`PipelineHost.logged`).

Two hosts: :class:`~batchtap.pipeline.transport.thread.ThreadPipeline` (a thread of the training process)
and :class:`~batchtap.pipeline.transport.process.ProcessPipeline` (a process of its own, fed through shared
memory, with a thread to fall back to); :func:`~batchtap.pipeline.transport.make.make_pipeline` makes the one
the Tap's settings name. Both feed a :class:`~batchtap.pipeline.chain.core.PipelineCore` and post to the
same :class:`~batchtap.pipeline.chain.control.Control`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from batchtap.pipeline.chain.messages import (
    Barrier,
    BlockRows,
    EpochStart,
    Events,
    FinishRun,
    FlushSinks,
    Handover,
    OpenChain,
    RanksFailed,
    Request,
    RunEnd,
    RunStart,
    StoredPosition,
    next_chain,
)
from batchtap.records import Event, RunInfo

if TYPE_CHECKING:
    from batchtap.capture.clock import DeviceGate
    from batchtap.capture.flush import Block
    from batchtap.capture.logged import Logged
    from batchtap.metrics.layout import Layout
    from batchtap.pipeline.chain.control import Control
    from batchtap.pipeline.chain.stages import ReduceSpec
    from batchtap.sinks.base import Sink

__all__ = ["PipelineHost", "PipelineKind"]

PipelineKind = Literal["thread", "process"]

#: seconds a resume may wait for the sinks to say where a run ended
_POSITION_TIMEOUT = 60.0


class PipelineHost(abc.ABC):
    """The training thread's side of a pipeline (see the module docstring). Every call but the
    waiting ones (``drain``, ``flush_sinks``, ``finish_run``, ``stored_position``, ``close``) only
    enqueues, except that a block's hand-over first waits for the verdict on the block before it
    when the pipeline is a whole flush behind (:meth:`number_block`)."""

    gate: DeviceGate  # paused around CUDA graph captures: no device queries meanwhile
    sinks: list[Sink]
    control: Control  # where the pipeline's verdicts, errors and judged blocks go

    # ------------------------------------------------------------------ what each host implements

    @abc.abstractmethod
    def send(self, message: Handover) -> None:
        """Hand ``message`` over, in order with everything else; never waits."""

    @abc.abstractmethod
    def ask(self, request: Request, timeout: float | None) -> Any:
        """Hand ``request`` over and wait for its answer (None when none came in time)."""

    @abc.abstractmethod
    def submit(self, block: Block, chain: int, logged: Sequence[Logged] = (), *, index: int | None = None) -> None:
        """Hand over a flushed block, with the ``log()`` values logged during its steps (stored
        together with its rows), once its copy completed.

        ``index``: the block's number in its chain when another host numbered it already (a
        failover); None numbers it here (:meth:`number_block`)."""

    @abc.abstractmethod
    def logged(self, logged: Logged, *, run_id: str, rank: int, writes: bool) -> None:
        """Hand over values from ``Tap.log()``: stored as a sparse record once their copy completed."""

    @abc.abstractmethod
    def open(self, message: OpenChain, *, max_rows: int) -> None:
        """Open a chain (a block of it never holds more than ``max_rows`` rows)."""

    @abc.abstractmethod
    def close(self, timeout: float | None = 30.0) -> None:
        """End the pipeline and close every sink (bounded). Idempotent."""

    def at_exit(self, timeout: float) -> None:
        """Interpreter exit with the Tap still open (daemon threads need nothing)."""

    # ------------------------------------------------------------------ numbering blocks

    def number_block(self, chain: int) -> int:
        """The next block's index in ``chain``. Every earlier block of it was judged first, so an
        input error their values revealed is raised by the next ``step()`` (see
        :meth:`~batchtap.pipeline.chain.control.Control.hand_block`)."""
        return self.control.hand_block(chain, wait=not self.gate.paused)

    def numbered(self, message: Handover) -> Handover:
        """``message``, a block given its index if it has none yet (a direct hand-over of rows)."""
        if isinstance(message, BlockRows) and message.index is None:
            return dataclasses.replace(message, index=self.number_block(message.chain))
        return message

    # ------------------------------------------------------------------ the Tap's calls, as messages

    def open_chain(
        self, layout: Layout, *, run_id: str, rank: int, writes: bool, reduce: ReduceSpec | None, max_rows: int = 0
    ) -> int:
        """The chain of a run whose capture was just made: its id, for the calls that name it."""
        message = OpenChain(next_chain(), layout.columns, run_id, rank, writes, reduce)
        self.open(message, max_rows=max_rows)
        return message.chain

    def events(self, events: list[Event], chain: int | None = None, *, writes: bool = True) -> None:
        """Hand over events raised on the training side (through ``chain``'s reducer when it has one)."""
        if events:
            self.send(Events(tuple(events), chain, writes))

    def start_run(self, run: RunInfo, *, writes: bool = True) -> None:
        if writes:
            self.send(RunStart(run))

    def end_run(self, run: RunInfo, *, writes: bool = True) -> None:
        if writes:
            self.send(RunEnd(run))

    def start_epoch(self, run_id: str, epoch: int, total: int | None, *, writes: bool = True) -> None:
        """An epoch of ``total`` batches began (for the sinks' progress displays)."""
        if writes:
            self.send(EpochStart(run_id, epoch, total))

    def ranks_failed(self, chain: int, reason: str) -> None:
        """The ranks' agreement failed: the chain stops exchanging (in order with the blocks)."""
        self.send(RanksFailed(chain, reason))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until everything handed over so far was processed and handed to the sinks.

        Returns False when ``timeout`` seconds passed first (the pipeline is stuck or gone).
        """
        # sync: run start/end, explicit flush — the caller asked for everything captured so far.
        passed = self.ask(Barrier(), timeout) is True
        # every block handed over was judged (or the wait ran out, at a run's end: what was judged
        # still counts): an input error a block revealed is due now
        self.control.release_held()
        return passed

    def flush_sinks(self, timeout: float | None = None) -> bool:
        # sync: run start/end, explicit flush — the sinks store what they were handed (bounded).
        return bool(self.ask(FlushSinks(timeout), timeout))

    def finish_run(self, info: RunInfo, *, timeout: float, last_step: int) -> bool:
        """Wait (bounded) until every step of the run is stored; report what is missing."""
        # sync: end of run — every captured step reaches the sinks before run() returns, within end_timeout.
        return bool(self.ask(FinishRun(info, timeout, last_step), timeout))

    def stored_position(self, run_id: str) -> tuple[list[int], list[str]]:
        """The last step each sink holds for ``run_id``, and the run's stored names."""
        # sync: resume — the sinks say where the run ended (once per resumed run).
        answer = self.ask(StoredPosition(run_id), _POSITION_TIMEOUT)
        return answer if answer is not None else ([], [])
