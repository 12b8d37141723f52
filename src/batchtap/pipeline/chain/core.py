"""What a pipeline does with each thing handed to it, wherever it runs.

:class:`PipelineCore` holds the sink workers (:class:`~batchtap.pipeline.chain.dispatch.Dispatcher`), the
rules stage, the open runs' chains and the :class:`~batchtap.pipeline.chain.control.Control` it posts to.
:meth:`PipelineCore.handle` takes every message of :mod:`batchtap.pipeline.chain.messages`, in order, from
whichever host feeds it: the pipeline thread (:mod:`batchtap.pipeline.transport.thread`), the pipeline
process (:mod:`batchtap.pipeline.transport.child`), or the thread a failed pipeline process hands over to.
Calls come from one thread at a time.

Nothing here loads torch: a chain decodes with the metrics' torch-free decoders, and only a
cross-rank reduction loads ``torch.distributed`` (:mod:`batchtap.pipeline.chain.reduce`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from batchtap.errors import InputError
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.dispatch import Backpressure, Dispatcher
from batchtap.pipeline.chain.ending import wait_for_sinks
from batchtap.pipeline.chain.messages import (
    Barrier,
    BlockRows,
    Close,
    EpochStart,
    Events,
    FinishRun,
    FlushSinks,
    Handover,
    LoggedValues,
    OpenChain,
    RanksFailed,
    Request,
    RunEnd,
    RunStart,
    StoredPosition,
)
from batchtap.sinks.base import Sink

if TYPE_CHECKING:
    from batchtap.pipeline.chain.stages import ReduceSpec, RulesStage, RunChain
    from batchtap.rules.engine import RuleEngine

__all__ = ["PipelineCore", "PipelineSettings"]


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineSettings:
    """How a pipeline treats its sinks and rules (the Tap's settings, wherever the pipeline runs).

    Attributes:
        queue_size: blocks queued per sink before ``backpressure`` applies.
        backpressure: ``"block"`` or ``"drop_oldest"``.
        rules: the rule engine, or None.
    """

    queue_size: int = 64
    backpressure: Backpressure = "block"
    rules: RuleEngine | None = None


def _handled(timeout: float | None) -> bool:
    """The drain of a core fed in order: everything before a request was handled already."""
    return True


class PipelineCore:
    """See the module docstring.

    Args:
        sinks: where records go (each gets a worker thread and a bounded queue).
        control: where verdicts, errors and anomaly counts go.
        settings: queues, backpressure and rules.
        join: turns an :class:`OpenChain`'s reduction into one with a live group (a pipeline
            process joins its own group there); default: used as it comes.
    """

    def __init__(
        self,
        sinks: Sequence[Sink],
        control: Control,
        settings: PipelineSettings | None = None,
        *,
        join: Callable[[ReduceSpec], ReduceSpec] | None = None,
    ) -> None:
        settings = settings or PipelineSettings()
        self.sinks = list(sinks)
        self.control = control
        self.dispatcher = Dispatcher(self.sinks, maxsize=settings.queue_size, policy=settings.backpressure)
        self.engine = settings.rules
        self.chains: dict[int, RunChain] = {}
        self._rules: RulesStage | None = None
        self._join = join
        self._counts: dict[str, int] = {}  # the anomaly counts last handed to the control

    def handle(self, message: Handover | Request) -> Any:
        """Do what ``message`` asks; a request's answer is returned (None for the rest)."""
        match message:
            case BlockRows():
                self._block(message)
            case LoggedValues(record=record, writes=writes):
                if writes:
                    self.dispatcher.write([record], [])
            case Events():
                self._events(message)
            case OpenChain():
                self._open_chain(message)
            case RanksFailed(chain=chain, reason=reason):
                self.chains[chain].ranks_failed(reason)
            case RunStart(run=run):
                self.dispatcher.start_run(run)
            case RunEnd(run=run):
                self.dispatcher.end_run(run)
            case EpochStart(run_id=run_id, epoch=epoch, total=total):
                self.dispatcher.start_epoch(run_id, epoch, total)
            case Barrier():
                return True
            case FlushSinks(timeout=timeout):
                return self.flush_sinks(timeout)
            case FinishRun():
                return self.finish_run(message, drain=_handled)
            case StoredPosition(run_id=run_id):
                return self.stored_position(run_id)
            case Close(timeout=timeout):
                self.close(timeout)
                return True
            case _:
                raise TypeError(f"expected a pipeline message (batchtap.pipeline.chain.messages), got {message!r}")
        return None

    # ------------------------------------------------------------------ the hand-overs

    def _open_chain(self, message: OpenChain) -> None:
        # Imported here, not at the top: a pipeline process answers a run's start before it loads
        # the decoders and the rules.
        from batchtap.pipeline.chain.stages import RulesStage, RunChain

        if self.engine is not None:
            if self._rules is None:
                self._rules = RulesStage(self.engine)
            self.engine.reset()  # the rules start afresh with each run
        reduce = message.reduce
        if reduce is not None and self._join is not None:
            reduce = self._join(reduce)
        chain = RunChain(
            message.columns,
            run_id=message.run_id,
            rank=message.rank,
            writes=message.writes,
            reduce=reduce,
            rules=self._rules,
        )
        self.chains = {message.chain: chain}  # one run at a time: the last run's chain is done
        self._counts = {}
        self.control.count_anomalies({})

    def _block(self, message: BlockRows) -> None:
        """Run a block through its chain, post what the training side needs, dispatch the rest.

        The block is reported judged (with its input error) before it is dispatched: a slow sink
        delays the judging of a later block only once its queue is full. A block that fails to go
        through is reported judged too (its failure is raised instead), so the training thread
        never waits for it."""
        judged = False
        try:
            chain = self.chains[message.chain]
            processed = chain.process(message.data)
            error = InputError(processed.input_errors[0]) if processed.input_errors else None
            if processed.verdict is not None:
                self.control.post(processed.verdict)
            counts = chain.anomaly_counts
            if counts != self._counts:
                self._counts = counts
                self.control.count_anomalies(counts)
            judged = True
            if message.index is not None:
                self.control.judged(message.chain, message.index, error)
            elif error is not None:
                self.control.fail(error)
        finally:
            if not judged and message.index is not None:
                self.control.judged(message.chain, message.index)
        if chain.writes:
            # the log() records of the block's steps go in the same write: no reader sees the rows without them
            records = [*processed.records, *message.logged] if message.logged else processed.records
            self.dispatcher.write(records, processed.events)

    def _events(self, message: Events) -> None:
        chain = self.chains.get(message.chain) if message.chain is not None else None
        events = list(message.events)
        events = chain.route_events(events) if chain is not None else (events if message.writes else [])
        if events:
            self.dispatcher.write([], events)

    # ------------------------------------------------------------------ the requests

    def flush_sinks(self, timeout: float | None = None) -> bool:
        # sync: run start/end, explicit flush — the sinks store what they were handed (bounded).
        return self.dispatcher.flush(timeout=timeout)

    def finish_run(self, message: FinishRun, *, drain: Callable[[float | None], bool]) -> bool:
        """Wait (bounded) until every step of the run is stored, then report what is missing.
        ``drain(timeout)`` waits for what is still on its way to this core (the host knows how)."""
        # sync: end of run — every captured step reaches the sinks before run() returns, within end_timeout.
        return wait_for_sinks(drain, self.dispatcher, message.run, timeout=message.timeout, last_step=message.last_step)

    def stored_position(self, run_id: str) -> tuple[list[int], list[str]]:
        """The last step and name each sink holds for ``run_id`` (sinks that know)."""
        self.dispatcher.flush()  # sink workers idle: the sinks can be asked directly
        steps = [s for s in (sink.last_step(run_id) for sink in self.sinks) if s is not None]
        names = [n for n in (sink.run_name(run_id) for sink in self.sinks) if n is not None]
        return steps, names

    def close(self, timeout: float | None = 30.0) -> None:
        self.dispatcher.close(timeout=timeout)
