"""PipelineCore on its own: every message of batchtap.pipeline.chain.messages, built directly from BlockData."""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np
import pytest
import torch

from batchtap.errors import InputError
from batchtap.metrics import Accuracy
from batchtap.metrics.base import StepInputs
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.core import PipelineCore, PipelineSettings
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
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.rules import NonFinite, RuleEngine
from tests.conftest import ListSink
from tests.pipeline._blocks import loss_block, opening, rows


@pytest.fixture
def sink() -> ListSink:
    return ListSink()


@pytest.fixture
def core(sink: ListSink) -> typing.Iterator[PipelineCore]:
    core = PipelineCore([sink], Control())
    yield core
    core.close(timeout=10)


def _run(run_id: str = "r") -> RunInfo:
    return RunInfo(run_id, "name", {}, 0.0)


def _logged(step: int) -> Record:
    return Record("r", step, 0, -1, 0, 5.0, {"val": 0.5}, sparse=True)


def test_a_block_reaches_the_sinks_as_records_with_its_logged_values_in_the_same_write(
    core: PipelineCore, sink: ListSink
) -> None:
    core.handle(RunStart(_run()))
    core.handle(opening(1))
    core.handle(BlockRows(1, loss_block([0.5, 0.25, 0.125]), (_logged(2),)))
    assert core.handle(FlushSinks(10)) is True
    assert [r.step for r in sink.records if not r.sparse] == [0, 1, 2]
    assert [r.values["loss"] for r in sink.records if not r.sparse] == [0.5, 0.25, 0.125]
    assert [r.values for r in sink.records if r.sparse] == [{"val": 0.5}]
    assert sink.writes == 1  # rows and log() values in one write
    assert [run.id for run in sink.started] == ["r"]


def test_a_rank_that_does_not_write_hands_nothing_to_its_sinks(core: PipelineCore, sink: ListSink) -> None:
    core.handle(opening(1, writes=False))
    core.handle(rows(1, [0.5]))
    core.handle(LoggedValues(_logged(0), writes=False))
    core.handle(Events((Event("r", 0, EventKind.WARNING, "w", 0.0),), None, writes=False))
    assert core.handle(FlushSinks(10))
    assert sink.records == [] and sink.events == []


def test_events_without_a_chain_and_logged_values_are_written_where_the_rank_writes(
    core: PipelineCore, sink: ListSink
) -> None:
    event = Event("r", 3, EventKind.WARNING, "from the training side", 0.0)
    core.handle(Events((event,), None, writes=True))
    core.handle(LoggedValues(_logged(3), writes=True))
    core.handle(EpochStart("r", 1, 10))
    core.handle(RunEnd(_run()))
    assert core.handle(FlushSinks(10))
    assert sink.events == [event]
    assert [r.step for r in sink.records] == [3]
    assert [run.id for run in sink.ended] == ["r"]


def test_anomaly_counts_are_handed_over_as_snapshots(core: PipelineCore) -> None:
    control = core.control
    core.handle(opening(1))
    core.handle(rows(1, [math.nan, 0.5]))
    first = control.anomaly_counts
    assert first == {"loss": 1}
    core.handle(rows(1, [math.inf], first_step=2))
    assert control.anomaly_counts == {"loss": 2}
    assert first == {"loss": 1}  # the earlier snapshot did not move: nothing live is shared
    core.handle(opening(2))  # a new run's chain counts afresh
    assert control.anomaly_counts == {}


def test_an_input_error_the_values_reveal_is_posted_to_the_control(sink: ListSink) -> None:
    """Class indices out of range show only in the values: the core fails the control with an
    InputError (the training thread raises it at its next step) and still stores the block."""
    metric = Accuracy()
    inputs = StepInputs(torch.tensor(0.5), torch.randn(4, 5, generator=torch.Generator().manual_seed(0)), None, 4.0)
    targets = torch.tensor([0, 1, 2, 7])  # 7: out of range for 5 classes
    inputs = StepInputs(inputs.loss, inputs.outputs, targets, 4.0)
    data = loss_block([0.0])
    data = dataclasses.replace(
        data,
        device_values=np.array([[float(v) for v in metric.compute(inputs)]]),
        host_values=np.array([list(metric.read_host(inputs))], dtype=np.float64),
    )
    core = PipelineCore([sink], Control())
    try:
        core.handle(OpenChain(1, Layout([metric]).columns, "r", 0, True))
        core.handle(BlockRows(1, data))
        error = core.control.take_error()
        assert isinstance(error, InputError) and "7" in str(error)
        assert core.handle(FlushSinks(10)) and [r.step for r in sink.records] == [0]
    finally:
        core.close(timeout=10)


def test_the_rules_verdict_is_posted_and_the_rules_judge_each_run_afresh(sink: ListSink) -> None:
    engine = RuleEngine([NonFinite("loss")])
    core = PipelineCore([sink], Control(), PipelineSettings(rules=engine))
    try:
        core.handle(opening(1))
        core.handle(rows(1, [0.5, math.nan]))
        assert core.control.waiting == 1
        (verdict,) = core.control.take_verdicts(1)
        assert [(d.metric, d.step) for d in verdict.decisions] == [("loss", 1)]
        core.handle(opening(2))
        core.handle(rows(2, [math.nan]))  # the same step again in a new run: judged afresh
        assert [(d.metric, d.step) for v in core.control.take_verdicts(1) for d in v.decisions] == [("loss", 0)]
    finally:
        core.close(timeout=10)


def test_ranks_failed_reaches_the_chain(core: PipelineCore) -> None:
    core.handle(opening(1))
    core.handle(RanksFailed(1, "the agreement exchange failed"))  # no reducer: nothing to stop, no error
    with pytest.raises(KeyError):
        core.handle(RanksFailed(2, "a chain never opened"))


def test_the_requests_answer(core: PipelineCore, sink: ListSink) -> None:
    run = _run()
    core.handle(RunStart(run))
    core.handle(opening(1))
    core.handle(rows(1, [0.5, 0.5]))
    assert core.handle(Barrier()) is True
    assert core.handle(FlushSinks(10)) is True
    assert core.handle(StoredPosition("r")) == ([], [])  # a ListSink does not know positions
    ended = RunInfo("r", "name", {}, 0.0, status=RunStatus.FINISHED)
    core.handle(RunEnd(ended))
    assert core.handle(FinishRun(ended, 10.0, 1)) is True
    assert core.handle(Close(10)) is True
    assert sink.closed


def test_something_else_is_refused_with_what_was_expected(core: PipelineCore) -> None:
    with pytest.raises(TypeError, match="expected a pipeline message"):
        core.handle(("block", 1))  # type: ignore[arg-type]


def test_every_kind_of_message_has_its_case() -> None:
    """Adding a kind to messages.Handover or messages.Request without its case in handle() fails here."""
    samples: dict[type, object] = {
        OpenChain: opening(1),
        BlockRows: rows(1, [0.5]),
        LoggedValues: LoggedValues(_logged(0), True),
        Events: Events((), 1, True),
        RanksFailed: RanksFailed(1, "why"),
        RunStart: RunStart(_run()),
        RunEnd: RunEnd(_run()),
        EpochStart: EpochStart("r", 0, None),
        Barrier: Barrier(),
        FlushSinks: FlushSinks(10),
        FinishRun: FinishRun(_run(), 10.0, 0),
        StoredPosition: StoredPosition("r"),
        Close: Close(10),
    }
    kinds = set(typing.get_args(Handover)) | set(typing.get_args(Request))
    assert kinds == set(samples), "give the new message kind a sample here"
    core = PipelineCore([ListSink()], Control())
    for message in samples.values():  # in this order: the chain opens first, Close last
        core.handle(message)  # type: ignore[arg-type]


def test_messages_are_frozen_values() -> None:
    message = rows(1, [0.5])
    with pytest.raises(AttributeError):
        message.chain = 2  # type: ignore[misc]
    assert Barrier() == Barrier() and FlushSinks(1.0) == FlushSinks(1.0)
