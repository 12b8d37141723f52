"""Everything the training side hands to a pipeline, one frozen dataclass per kind.

Both hosts (the pipeline thread, the pipeline process), the process's failover to a thread and its
restart all move these same values, and :meth:`~batchtap.pipeline.chain.core.PipelineCore.handle` is the
one place that says what each does. The sink calls are the record codec's own values
(:class:`~batchtap.records.RunStart`, :class:`~batchtap.records.RunEnd`,
:class:`~batchtap.records.EpochStart`), which the sinks' workers and the resilient sink's spool use
too.

Adding a kind of hand-over: its dataclass here (in :data:`Handover` or :data:`Request`), and its
case in ``PipelineCore.handle``.

A chain is named by an ``int`` that the training side allocates (:func:`next_chain`), so a message
means the same in the training process, in a pipeline process and after a failover.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

from batchtap.records import EpochStart, Event, Record, RunEnd, RunInfo, RunStart

if TYPE_CHECKING:  # annotations only: a pipeline process answers a run's start before it loads numpy
    from batchtap.metrics.decoding import BlockData, ColumnLayout
    from batchtap.pipeline.chain.stages import ReduceSpec

__all__ = [
    "Barrier",
    "BlockRows",
    "Close",
    "Events",
    "FinishRun",
    "FlushSinks",
    "Handover",
    "LoggedValues",
    "OpenChain",
    "RanksFailed",
    "Request",
    "StoredPosition",
    "next_chain",
    "EpochStart",
    "RunEnd",
    "RunStart",
]

_chains = itertools.count(1)


def next_chain() -> int:
    """A chain id unique in this process (shared by every host of it, so a failover keeps ids)."""
    return next(_chains)


# ---------------------------------------------------------------------- hand-overs (nothing waits)


@dataclasses.dataclass(frozen=True, slots=True)
class OpenChain:
    """A run's capture was made: open its chain (decode, validate, reduce, rules).

    ``columns`` say what a block's columns hold: each metric's decoder (torch-free for the built-in
    metrics, so a pipeline process decodes without loading torch) and outputs. ``reduce`` is the
    cross-rank reduction or
    None; in a pipeline process its ``group`` is where the processes meet (see
    :mod:`batchtap.pipeline.transport.child`).
    """

    chain: int
    columns: ColumnLayout
    run_id: str
    rank: int
    writes: bool
    reduce: ReduceSpec | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRows:
    """A block's rows read back, with the ``log()`` records of its steps (stored in one write).

    ``index`` is the block's number in its chain as the training side handed it over
    (:meth:`~batchtap.pipeline.chain.control.Control.hand_block`): the core reports the block judged
    under it, with the input error its values revealed. None: a block no one numbered (a direct
    hand-over in a test), whose input error fails the control at once."""

    chain: int
    data: BlockData
    logged: tuple[Record, ...] = ()
    index: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LoggedValues:
    """``Tap.log()`` values outside any block, as their sparse record."""

    record: Record
    writes: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Events:
    """Events raised on the training side: through ``chain``'s reducer when it has one."""

    events: tuple[Event, ...]
    chain: int | None
    writes: bool


@dataclasses.dataclass(frozen=True, slots=True)
class RanksFailed:
    """The ranks' agreement failed: ``chain`` stops exchanging (in order with its blocks)."""

    chain: int
    reason: str


#: what a host hands over without waiting for an answer
Handover = OpenChain | BlockRows | LoggedValues | Events | RanksFailed | RunStart | RunEnd | EpochStart


# ---------------------------------------------------------------------- requests (the caller waits)


@dataclasses.dataclass(frozen=True, slots=True)
class Barrier:
    """Answered True once everything handed over before it was processed."""


@dataclasses.dataclass(frozen=True, slots=True)
class FlushSinks:
    """The sinks store what they were handed (bounded by ``timeout``); answers whether all did."""

    timeout: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class FinishRun:
    """Every step of ``run`` stored (bounded by ``timeout``), what is missing reported; answers
    whether all was stored."""

    run: RunInfo
    timeout: float
    last_step: int


@dataclasses.dataclass(frozen=True, slots=True)
class StoredPosition:
    """Answers (the last step each sink holds for ``run_id``, the run's stored names)."""

    run_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class Close:
    """Close the sinks (bounded by ``timeout``); answers True."""

    timeout: float | None = 30.0


#: what a host hands over and then waits for the answer to
Request = Barrier | FlushSinks | FinishRun | StoredPosition | Close
