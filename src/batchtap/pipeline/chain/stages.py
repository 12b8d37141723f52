"""The pipeline's one chain: block → decode → validate → reduce across ranks → rules → dispatch.

A :class:`RunChain` holds what one run's blocks go through; :meth:`RunChain.process` runs every stage
but the dispatch and returns a :class:`Processed` (records and events for the sinks, the rules'
verdict for the training thread). The same chain runs on the pipeline thread
(:mod:`batchtap.pipeline.transport.thread`) or in the pipeline process (:mod:`batchtap.pipeline.transport.process`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from batchtap.metrics.decoding import BlockData, ColumnLayout
from batchtap.pipeline.chain.control import Verdict
from batchtap.pipeline.chain.decode import Decoder
from batchtap.pipeline.chain.reduce import Reducer
from batchtap.pipeline.chain.rows import DecodedBlock
from batchtap.records import ALL_RANKS, Event, Record
from batchtap.rules.engine import RuleEngine

__all__ = ["RulesStage", "RunChain", "Processed", "ReduceSpec"]


class RulesStage:
    """Runs the rule engine on each block's records (the reduced rows in a process group) and
    returns what the training side must do; the engine's anomaly events join the block's events."""

    def __init__(self, engine: RuleEngine) -> None:
        self.engine = engine

    def judge(self, records: list[Record], events: list[Event]) -> Verdict | None:
        engine = self.engine
        if any(r.rank == ALL_RANKS for r in records):
            records = [r for r in records if r.rank == ALL_RANKS]  # rules judge the reduced rows
        before = engine.cleared_through
        decisions = engine.process(records)
        events.extend(engine.take_events())
        if decisions or engine.cleared_through != before:
            return Verdict(decisions, engine.cleared_through)
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class ReduceSpec:
    """How a run reduces its records across ranks (None outside a process group)."""

    group: Any  # batchtap's reduction gloo group
    rank: int
    world_size: int
    per_rank_rows: bool


@dataclasses.dataclass(slots=True)
class Processed:
    """One block after every stage but the dispatch."""

    records: list[Record]
    events: list[Event]
    verdict: Verdict | None
    input_errors: list[str]


class RunChain:
    """What the pipeline does with one run's blocks.

    Args:
        layout: the run's columns (each metric's decoder and outputs, in order).
        run_id: the run.
        rank: this process's rank.
        writes: whether this process hands records to its sinks (rank 0 in a process group).
        reduce: the cross-rank reduction, or None.
        rules: the rules stage, or None.
    """

    def __init__(
        self,
        layout: ColumnLayout,
        *,
        run_id: str,
        rank: int,
        writes: bool,
        reduce: ReduceSpec | None = None,
        rules: RulesStage | None = None,
    ) -> None:
        self.decoder = Decoder(layout, run_id=run_id, rank=rank, weights=reduce is not None)
        self.reducer: Reducer | None = None
        if reduce is not None:
            outputs = list(layout.outputs)
            self.reducer = Reducer(
                outputs,
                group=reduce.group,
                rank=reduce.rank,
                world_size=reduce.world_size,
                per_rank_rows=reduce.per_rank_rows,
            )
        self.rules = rules
        self.writes = writes
        # training-thread events held back to travel with the next block through the reducer, so
        # the writing rank stores every rank's events
        self._held: list[Event] = []

    @property
    def run_id(self) -> str:
        return self.decoder.run_id

    @property
    def rank(self) -> int:
        return self.decoder.rank

    @property
    def anomaly_counts(self) -> dict[str, int]:
        return dict(self.decoder.anomaly_counts)

    def process(self, data: BlockData) -> Processed:
        block: DecodedBlock = self.decoder.decode(data)
        if self._held:
            block.events[:0], self._held = self._held, []
        if self.reducer is not None:
            block = self.reducer.reduce(block, data.samples, data.step_time)
        records = block.records  # made once, here, for the rules and the sinks
        verdict = self.rules.judge(records, block.events) if self.rules is not None else None
        return Processed(records, block.events, verdict, block.input_errors)

    def route_events(self, events: list[Event]) -> list[Event]:
        """Events from the training side: held for the next block's exchange in a working process
        group (returns nothing to write now), else returned to write now (where this rank writes)."""
        if self.reducer is not None and not self.reducer.broken:
            self._held.extend(events)
            return []
        return events if self.writes else []

    def ranks_failed(self, reason: str) -> None:
        """The ranks can no longer exchange (a collective failed): stop reducing, write locally."""
        if self.reducer is not None:
            self.reducer.broken = reason
