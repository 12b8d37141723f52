"""``tap.log()``: evaluation and epoch values at any time, any key, no host read."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from batchtap.records import Event, Record
from batchtap.sinks.base import Sink
from tests.conftest import ListSink


def test_values_first_seen_at_any_step_are_stored_as_their_own_records(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink], flush_every=4) as tap, tap.run():
        for step in range(10):
            tap.step(loss=torch.tensor(1.0 / (step + 1)))
            if step % 5 == 4:
                tap.log({"val_loss": 0.5 - step / 100, "val_acc": torch.tensor(0.25 * (step // 5 + 1))})
        tap.log({"test_acc": 0.875}, step=3)
    steps = [r for r in sink.records if not r.sparse]
    sparse = [r for r in sink.records if r.sparse]
    assert [r.step for r in steps] == list(range(10))
    assert all(set(r.values) == {"loss"} for r in steps)  # step rows are not padded with eval names
    assert [(r.step, dict(r.values)) for r in sparse] == [
        (4, {"val_loss": pytest.approx(0.46), "val_acc": 0.25}),
        (9, {"val_loss": pytest.approx(0.41), "val_acc": 0.5}),
        (3, {"test_acc": 0.875}),
    ]
    assert not sink.events


class WriteLog(Sink):
    """One JSON line per ``write()``: the (step, sparse) of each record it carried (it pickles, so
    it works in the pipeline process too)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps([[r.step, r.sparse] for r in records]) + "\n")


@pytest.mark.parametrize("pipeline", ["thread", "process"])
def test_logged_values_are_written_with_the_rows_of_the_steps_before_them(tmp_path: Path, pipeline: str) -> None:
    # A reader of the store (batchtap tail) must never see step 5's row without the value logged
    # after step 5: they arrive in one write (one transaction of a store sink).
    path = tmp_path / "writes.jsonl"
    with bt.Tap([bt.metrics.Loss()], [WriteLog(path)], flush_every=4, pipeline=pipeline) as tap, tap.run():
        for step in range(12):
            tap.step(loss=torch.tensor(float(step)))
            if step in (5, 6):
                tap.log({f"val_{step}": torch.tensor(0.5)})
    writes = [json.loads(line) for line in path.read_text().splitlines()]
    where = {
        (step, sparse): i for i, w in enumerate(writes) for step, sparse in w
    }  # (the sink worker may merge blocks)
    assert where[(5, True)] == where[(5, False)] == where[(7, False)], writes  # with the block of steps 4..7
    assert where[(6, True)] == where[(6, False)], writes
    w = writes[where[(5, True)]]
    assert w.index([5, True]) > w.index([7, False]) and w.index([6, True]) > w.index(
        [5, True]
    )  # after its rows, in order
    assert sorted(s for w in writes for s, sparse in w if not sparse) == list(range(12))


def test_log_before_the_first_step_and_without_any_step(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap:
        with tap.run():
            tap.log({"baseline_acc": torch.tensor(0.1)})
        with tap.run():
            tap.log({"x": 2})
            tap.step(loss=torch.tensor(0.5))
    assert [(r.step, dict(r.values), r.sparse) for r in sink.records] == [
        (0, {"baseline_acc": pytest.approx(0.1)}, True),
        (0, {"x": 2.0}, True),
        (0, {"loss": 0.5}, False),
    ]


def test_log_copies_the_value_at_the_call_not_later(sink: ListSink) -> None:
    running = torch.zeros(())
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.step(loss=torch.tensor(1.0))
        running += 3
        tap.log({"eval_sum": running})
        running += 100  # an in-place update after log() must not change what was logged
    assert [r.values for r in sink.records if r.sparse] == [{"eval_sum": 3.0}]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param({"loss": 0.1}, "already a per-step value", id="clashes-with-a-step-value"),
        pytest.param({"step": 1}, "already a per-step value or record field", id="reserved-field"),
        pytest.param({"": 1.0}, "non-empty strings", id="empty-name"),
        pytest.param({"v": torch.ones(3)}, "0-dim tensor", id="not-a-scalar"),
        pytest.param({"v": "high"}, "number or a 0-dim tensor, got str", id="text"),
        pytest.param({"v": 10**400}, "does not fit a float", id="huge-int"),
        pytest.param({}, "non-empty mapping", id="empty"),
    ],
)
def test_bad_log_calls_are_refused_and_lose_nothing(values: dict, message: str) -> None:
    sink = ListSink()
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.step(loss=torch.tensor(1.0))
        with pytest.raises(bt.InputError, match=message):
            tap.log(values)
        tap.step(loss=torch.tensor(2.0))
    assert [r.values["loss"] for r in sink.records] == [1.0, 2.0]


def test_log_reads_nothing_on_the_host(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.step(loss=torch.tensor(1.0))
        val = torch.randn(64).abs().mean()
        with HostReadCounter() as reads:
            for i in range(50):
                tap.step(loss=torch.tensor(1.0))
                tap.log({"val_loss": val * i, "epoch_seconds": 1.5})
        assert reads.count == 0, reads.reads
    assert len([r for r in sink.records if r.sparse]) == 50


def test_sparse_values_land_in_the_default_sqlite_store(tmp_path, monkeypatch) -> None:
    db = tmp_path / "runs" / "batchtap.db"
    monkeypatch.setenv("BATCHTAP_DB", str(db))
    with bt.Tap([bt.metrics.Loss()]) as tap, tap.run(name="eval") as info:
        for _ in range(3):
            tap.step(loss=torch.tensor(0.5))
        tap.log({"val_loss": 0.25})
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT metric, step, value FROM metrics WHERE run_id = ? ORDER BY metric, step", (info.id,)
        ).fetchall()
    assert rows == [("loss", 0, 0.5), ("loss", 1, 0.5), ("loss", 2, 0.5), ("val_loss", 2, 0.25)]
