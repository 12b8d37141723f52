"""``bt.sinks.TensorBoard``: event files read back with TensorBoard's EventAccumulator."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from batchtap.errors import SinkError
from batchtap.records import ALL_RANKS, RunStatus
from tests.store._helpers import ODD_NAMES, make_events, make_records, make_run, make_skips, make_sparse

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from batchtap.sinks.tensorboard import TensorBoard  # noqa: E402


def _load(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _f32(x: float) -> float:
    import numpy as np

    return float(np.float32(x))


def test_scalars_carry_the_records_own_step_and_wall_time(tmp_path: Path) -> None:
    run = make_run()
    records = make_records(run.id, range(25), ["loss", "acc"], random.Random(30), nan_every=6)
    sink = TensorBoard(tmp_path)
    sink.start_run(run)
    sink.write(records[:10])
    sink.write(records[10:])
    sink.close()
    acc = _load(tmp_path)
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/acc"}
    for tag, metric in (("train/loss", "loss"), ("train/acc", "acc")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r.step for r in records]
        assert [e.wall_time for e in events] == [r.wall_time for r in records]
        for e, r in zip(events, records):
            v = r.values[metric]
            assert math.isnan(e.value) if math.isnan(v) else e.value == _f32(v)  # TensorBoard keeps float32


def test_ranks_get_their_own_tags(tmp_path: Path) -> None:
    rng = random.Random(31)
    sink = TensorBoard(tmp_path)
    sink.write(make_records("r", range(3), ["loss"], rng, rank=ALL_RANKS))
    sink.write(make_records("r", range(3), ["loss"], rng, rank=2))
    sink.close()
    assert set(_load(tmp_path).Tags()["scalars"]) == {"train/loss", "train/loss/rank2"}


def test_events_and_run_status_are_text(tmp_path: Path) -> None:
    run = make_run()
    events = make_events(run.id)
    sink = TensorBoard(tmp_path)
    sink.start_run(run)
    sink.write(make_records(run.id, range(8), ["loss"], random.Random(32)), events)
    sink.end_run(replace(run, status=RunStatus.STOPPED, ended_at=run.started_at + 1, stop_reason="loss diverged"))
    sink.close()
    acc = _load(tmp_path)
    anomalies = acc.Tensors("events/anomaly/text_summary")
    assert [t.step for t in anomalies] == [3, 4, 5]
    assert [t.wall_time for t in anomalies] == [e.wall_time for e in events[:3]]
    texts = [t.tensor_proto.string_val[0].decode() for t in anomalies]
    assert "raw value 1.5" in texts[0] and "acc 1.5 outside [0, 1]" in texts[0]
    assert "raw value nan" in texts[1] and "raw value -inf" in texts[2]
    actions = acc.Tensors("events/action/text_summary")
    assert "stop: loss diverged" in actions[0].tensor_proto.string_val[0].decode()
    status = acc.Tensors("run/status/text_summary")[0].tensor_proto.string_val[0].decode()
    assert status == "stopped: loss diverged"
    assert run.id in acc.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_odd_metric_names(tmp_path: Path) -> None:
    names = [n for n in ODD_NAMES if "\n" not in n]
    records = make_records("r", range(2), names, random.Random(33))
    sink = TensorBoard(tmp_path)
    sink.write(records)
    sink.close()
    acc = _load(tmp_path)
    for name in names:
        assert [e.value for e in acc.Scalars(f"train/{name}")] == [_f32(r.values[name]) for r in records]


def test_unwritable_log_dir_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(SinkError, match=r"a-file.*fix"):
        TensorBoard(blocker / "logs")


def test_sparse_values_are_scalars_named_as_logged_at_their_step(tmp_path: Path) -> None:
    rng = random.Random(34)
    run = make_run()
    steps = make_records(run.id, range(20), ["loss"], rng)
    evals = make_sparse(run.id, [9, 19], rng)
    late = make_sparse(run.id, [19], rng, names=("bleu",))
    other_rank = make_sparse(run.id, [19], rng, rank=1)
    sink = TensorBoard(tmp_path)
    sink.write([*steps[:10], evals[0], *steps[10:]], make_skips(run.id, [4]))
    sink.write([evals[1], late[0], other_rank[0]])
    sink.close()
    acc = _load(tmp_path)
    assert set(acc.Tags()["scalars"]) == {
        "train/loss", "val_loss", "val_acc", "bleu", "val_loss/rank1", "val_acc/rank1",
    }  # fmt: skip
    for name in ("val_loss", "val_acc"):
        got = acc.Scalars(name)
        assert [(e.step, e.wall_time, e.value) for e in got] == [
            (r.step, r.wall_time, _f32(r.values[name])) for r in evals
        ]
    assert [e.step for e in acc.Scalars("bleu")] == [19]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(20))
    assert [t.step for t in acc.Tensors("events/skip/text_summary")] == [4]
