"""What a pipeline does with each thing handed to it, wherever it runs.

:class:`PipelineCore` holds the sink workers (:class:`~batchtap.pipeline.dispatch.Dispatcher`), the
rules stage and the :class:`~batchtap.pipeline.control.Control` it posts to, and handles each kind of
hand-over: a block's rows, ``log()`` values, events, a run's start and end. Both hosts drive one:
the pipeline thread (:mod:`batchtap.pipeline.thread`) and the pipeline process's main loop
(:mod:`batchtap.pipeline.process`). Calls come from one thread at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batchtap.pipeline.ending import wait_for_sinks
from batchtap.capture.flush import BlockData
from batchtap.errors import InputError
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain import ReduceSpec, RulesStage, RunChain
from batchtap.pipeline.control import Control
from batchtap.pipeline.dispatch import Backpressure, Dispatcher
from batchtap.records import Event, Record, RunInfo
from batchtap.rules.engine import RuleEngine
from batchtap.sinks.base import Sink

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


class PipelineCore:
    """See the module docstring.

    Args:
        sinks: where records go (each gets a worker thread and a bounded queue).
        control: where verdicts, errors and anomaly counts go.
        settings: queues, backpressure and rules.
    """

    def __init__(self, sinks: Sequence[Sink], control: Control, settings: PipelineSettings | None = None) -> None:
        settings = settings or PipelineSettings()
        self.sinks = list(sinks)
        self.control = control
        self.dispatcher = Dispatcher(self.sinks, maxsize=settings.queue_size, policy=settings.backpressure)
        self.rules = RulesStage(settings.rules) if settings.rules is not None else None

    def open_chain(
        self, layout: Layout, *, run_id: str, rank: int, writes: bool, reduce: ReduceSpec | None, max_rows: int = 0
    ) -> RunChain:
        """The chain of a run whose capture was just made (the rules start afresh)."""
        if self.rules is not None:
            self.rules.engine.reset()
        chain = RunChain(layout, run_id=run_id, rank=rank, writes=writes, reduce=reduce, rules=self.rules)
        self.control.anomaly_counts = chain.decoder.anomaly_counts  # live: read as the pipeline counts
        return chain

    def block(self, data: BlockData, chain: RunChain, logged: Sequence[Record] = ()) -> None:
        """Run a block through the chain, post what the training side needs, dispatch the rest.

        ``logged``: the sparse records of ``log()`` calls made during the block's steps, written
        with its rows in one hand-over so that no reader sees the rows after them without them.
        """
        processed = chain.process(data)
        if processed.input_errors:
            self.control.fail(InputError(processed.input_errors[0]))
        if processed.verdict is not None:
            self.control.post(processed.verdict)
        if chain.writes:
            records = [*processed.records, *logged] if logged else processed.records
            self.dispatcher.write(records, processed.events)

    def sparse(self, record: Record, *, writes: bool) -> None:
        """A sparse record (``log()`` values) where this rank writes."""
        if writes:
            self.dispatcher.write([record], [])

    def events(self, events: list[Event], chain: RunChain | None, writes: bool) -> None:
        """Events from the training side: through the chain's reducer when it has one."""
        events = chain.route_events(events) if chain is not None else (events if writes else [])
        if events:
            self.dispatcher.write([], events)

    def start_run(self, run: RunInfo) -> None:
        self.dispatcher.start_run(run)

    def end_run(self, run: RunInfo) -> None:
        self.dispatcher.end_run(run)

    def start_epoch(self, run_id: str, epoch: int, total: int | None) -> None:
        self.dispatcher.start_epoch(run_id, epoch, total)

    def flush_sinks(self, timeout: float | None = None) -> bool:
        # sync: run start/end, explicit flush — the sinks store what they were handed (bounded).
        return self.dispatcher.flush(timeout=timeout)

    def finish_run(self, drained: object, info: RunInfo, *, timeout: float, last_step: int) -> bool:
        """Wait (bounded) until every step of the run is stored, then report what is missing.
        ``drained`` is the host (its ``drain()`` waits for what is still on its way to this core)."""
        # sync: end of run — every captured step reaches the sinks before run() returns, within end_timeout.
        return wait_for_sinks(drained, self.dispatcher, info, timeout=timeout, last_step=last_step)  # type: ignore[arg-type]

    def stored_position(self, run_id: str) -> tuple[list[int], list[str]]:
        """The last step and name each sink holds for ``run_id`` (sinks that know)."""
        self.dispatcher.flush()  # sink workers idle: the sinks can be asked directly
        steps = [s for s in (sink.last_step(run_id) for sink in self.sinks) if s is not None]
        names = [n for n in (sink.run_name(run_id) for sink in self.sinks) if n is not None]
        return steps, names

    def close(self, timeout: float | None = 30.0) -> None:
        self.dispatcher.close(timeout=timeout)
