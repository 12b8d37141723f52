"""Issue 29, items 8 and 10: tests that fail on two one-line bugs an independent mutation run
planted and no test noticed (item 9, the fused count's float32, is
``tests/metrics/test_accuracy_every_step.py::test_fused_count_is_exact_past_2048_hits``).

``tools/mutate.py`` pins the lines these tests guard, so ``make mutate`` always runs their mutants.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence

import pytest
import torch

import batchtap as bt
from batchtap.pipeline.chain.dispatch import Dispatcher
from batchtap.records import Event, EventKind, Record, RunInfo
from batchtap.sinks.base import Sink
from tests.conftest import ListSink

# ---------------------------------------------------------------- item 8: capture/accumulate.py


@pytest.mark.parametrize("bad_first", [True, False], ids=["bad-micro-batch-first", "bad-micro-batch-second"])
def test_an_out_of_range_label_in_one_micro_batch_is_an_event_of_the_step(bad_first: bool) -> None:
    # The lowest kept target of the step is the minimum over its micro-batches: combining it with
    # maximum lets the valid micro-batch hide the bad one (no event, an accuracy of 0.125).
    g = torch.Generator().manual_seed(8)
    good = (torch.randn(4, 5, generator=g), torch.tensor([0, 1, 2, 3]))
    bad_targets = torch.tensor([1, -5, 2, 4])  # -5: neither a class nor the ignore_index
    bad = (torch.randn(4, 5, generator=g), bad_targets)
    order = [bad, good] if bad_first else [good, bad]
    sink = ListSink()
    with pytest.raises(bt.InputError, match=r"^step 1: targets hold class indices outside \[0, 5\) \(smallest -5"):
        with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=1) as tap, tap.run():
            tap.step(loss=torch.tensor(1.0), outputs=good[0], targets=good[1])  # step 0: fine
            for outputs, targets in order:
                tap.accumulate(loss=torch.tensor(1.0), outputs=outputs, targets=targets)
            tap.step()  # step 1
            for _ in range(100):  # the error surfaces once the row reached the host
                tap.flush()
                tap.step(loss=torch.tensor(1.0))
    anomalies = [e for e in sink.events if e.kind is EventKind.ANOMALY]
    assert [(e.step, e.metric) for e in anomalies] == [(1, "accuracy")]
    step1 = next(r for r in sink.records if r.step == 1)
    assert step1.values["accuracy"] != step1.values["accuracy"]  # NaN, not a number from a bad label


@pytest.mark.parametrize(
    ("reduce", "expected"),
    [(bt.metrics.Reduce.MIN, 1.0), (bt.metrics.Reduce.MAX, 7.0)],
    ids=["min-columns-only", "max-columns-only"],
)
def test_a_step_of_min_or_max_columns_alone_folds_its_micro_batches_by_that_kind(reduce, expected) -> None:
    # The fold has one branch for minima and maxima together (accuracy's range) and one for each
    # alone (a custom metric reduced by MIN or MAX): each must keep its own kind.
    metric = bt.metrics.Custom("peak", lambda loss: loss.detach(), requires=("loss",), reduce=reduce)
    sink = ListSink()
    with bt.Tap([metric], [sink], flush_every=1) as tap, tap.run():
        for value in (4.0, 1.0, 7.0, 2.0):
            tap.accumulate(loss=torch.tensor(value))
        tap.step()
    assert [r.values["peak"] for r in sink.records] == [expected]


# ---------------------------------------------------------------- item 10: pipeline/dispatch.py


class _StuckSink(Sink):
    """Blocks in its first write until released; keeps what it receives."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.records: list[Record] = []
        self.events: list[Event] = []
        self.lock = threading.Lock()

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never released the sink"
        with self.lock:
            self.records.extend(records)
            self.events.extend(events)


def _record(step: int) -> Record:
    return Record("r", step=step, epoch=0, batch=step, rank=0, wall_time=0.0, values={"loss": float(step)})


def test_reports_queued_behind_a_stuck_sink_survive_drop_oldest_and_the_queue_keeps_its_bound() -> None:
    sink = _StuckSink()
    maxsize = 3
    dispatcher = Dispatcher([sink], maxsize=maxsize, policy="drop_oldest")
    worker = dispatcher.workers[0]
    run = RunInfo(id="r", name="r", config={}, started_at=0.0)
    try:
        dispatcher.start_run(run)
        dispatcher.write([_record(0)], [])
        assert sink.entered.wait(30)  # the worker is stuck in its first write
        report = Event("r", 0, EventKind.WARNING, "report 1", 0.0)
        dispatcher.write([_record(1)], [])
        dispatcher.report([report])  # behind a write, in front of the drops below
        for step in range(2, 30):
            dispatcher.write([_record(step)], [])
            with worker._cv:  # the bound holds after every put
                queued = sum(1 for item in worker._items if getattr(item, "records", None))
            assert queued <= maxsize, queued
        late = Event("r", 29, EventKind.WARNING, "report 2", 0.0)
        dispatcher.report([late])
        assert worker.dropped_records == 30 - 1 - maxsize  # all but the stuck one and the newest maxsize
    finally:
        sink.release.set()
    assert dispatcher.flush(timeout=30)
    dispatcher.close()
    messages = [e.message for e in sink.events]
    assert "report 1" in messages and "report 2" in messages
    assert [r.step for r in sink.records] == [0, 27, 28, 29]


def test_drop_oldest_counts_every_dropped_record_in_the_run_report() -> None:
    sink = _StuckSink()
    dispatcher = Dispatcher([sink], maxsize=2, policy="drop_oldest")
    run = RunInfo(id="r", name="r", config={}, started_at=0.0)
    try:
        dispatcher.start_run(run)
        dispatcher.write([_record(0)], [])
        assert sink.entered.wait(30)
        for step in range(1, 8):
            dispatcher.write([_record(step), _record(100 + step)], [])
    finally:
        sink.release.set()
    deadline = time.monotonic() + 30
    while not dispatcher.flush(timeout=1) and time.monotonic() < deadline:
        pass
    report = dispatcher.loss_report(run)
    dispatcher.close()
    assert any("10" in e.message and "dropped" in e.message for e in report), [e.message for e in report]
    # each drop says which steps it dropped: the block's first and last record
    # (the warnings ride on later blocks, so some were dropped themselves: the report above counts all)
    drops = [e.message for e in sink.events if "dropped the oldest block" in e.message]
    spans = [re.search(r"\(steps (\d+)\.\.(\d+), 2 records;", m) for m in drops]
    assert drops and all(s is not None and int(s[2]) == int(s[1]) + 100 for s in spans), drops
