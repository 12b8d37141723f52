"""``bt.sinks.TensorBoard`` writes ``Histograms``' per-layer histograms as TensorBoard histograms:
the event files, read back with TensorBoard's own EventAccumulator, hold one histogram per layer,
kind and captured step whose buckets are the bins batchtap stored (SQLite, same run)."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from batchtap.records import Record

pytest.importorskip("tensorboard")
from tensorboard import data_compat  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

from batchtap.sinks.tensorboard import TensorBoard, _split_histograms  # noqa: E402

BINS, EVERY, STEPS = 8, 2, 5


def test_histograms_read_back_equal_what_batchtap_stored(tmp_path: Path) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    db, logs = tmp_path / "h.db", tmp_path / "tb"
    metrics = [bt.metrics.Loss(), bt.metrics.Histograms(model, every=EVERY, bins=BINS)]
    tap = bt.Tap(metrics, [bt.sinks.SQLite(db), TensorBoard(logs)], flush_every=3)
    with tap, tap.run(name="tb-hist") as run:
        for _ in range(STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,)))
            loss.backward()
            opt.step()
            tap.step(loss=loss)
    with sqlite3.connect(db) as conn:
        stored = conn.execute(
            "SELECT kind, layer, step, low, high, counts FROM histograms WHERE run_id = ? ORDER BY kind, layer, step",
            (run.id,),
        ).fetchall()
    assert len(stored) == 2 * 2 * len(range(0, STEPS, EVERY))
    acc = EventAccumulator(str(logs), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    assert sorted(tags["histograms"]) == [f"train/hist/{k}/{la}" for k in ("grad", "weight") for la in ("0", "2")]
    assert not [t for t in tags["scalars"] if "hist/" in t]  # histograms, not bins + 2 scalars each
    by_tag: dict[str, dict[int, object]] = {}
    for tag in tags["histograms"]:
        by_tag[tag] = {e.step: e.histogram_value for e in acc.Histograms(tag)}
    for kind, layer, step, low, high, counts in stored:
        counts = [float(c) for c in json.loads(counts)]
        histo = by_tag[f"train/hist/{kind}/{layer}"][step]
        edges = np.linspace(low, high, BINS + 1)
        assert (histo.min, histo.max) == (low, high)
        assert histo.bucket == counts, (kind, layer, step)
        assert histo.bucket_limit == edges[1:].tolist()  # bucket i's right edge
        assert histo.num == sum(counts)
    assert sorted({s for steps in by_tag.values() for s in steps}) == list(range(0, STEPS, EVERY))


def test_the_dashboards_see_the_stored_bin_edges(tmp_path: Path) -> None:
    # what TensorBoard's histogram plugin draws: the legacy proto migrated to [left, right, count] rows
    values = {"loss": 0.5, "hist/grad/fc/min": -1.0, "hist/grad/fc/max": 3.0}
    values.update({f"hist/grad/fc/{i}": float(c) for i, c in enumerate([2, 0, 1, 5])})
    sink = TensorBoard(tmp_path)
    sink.write([Record("r", step=7, epoch=0, batch=7, rank=1, wall_time=1.0, values=values)])
    sink.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "tensors": 0})
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/loss/rank1"]
    (event,) = acc.Histograms("train/hist/grad/fc/rank1")
    assert event.step == 7
    from tensorboard.compat.proto.summary_pb2 import HistogramProto, Summary

    h = event.histogram_value
    proto = HistogramProto(min=h.min, max=h.max, bucket_limit=h.bucket_limit, bucket=h.bucket)
    migrated = data_compat.migrate_value(Summary.Value(tag="t", histo=proto))
    rows = tensor_util.make_ndarray(migrated.tensor).tolist()
    assert rows == [[-1.0, 0.0, 2.0], [0.0, 1.0, 0.0], [1.0, 2.0, 1.0], [2.0, 3.0, 5.0]]


def test_incomplete_or_non_finite_histograms_stay_scalars() -> None:
    full = {"hist/weight/a.b/min": 0.0, "hist/weight/a.b/max": 2.0, "hist/weight/a.b/0": 1.0, "hist/weight/a.b/1": 3.0}
    scalars, histograms = _split_histograms({**full, "hist/other": 1.0, "hist/weight/c/min": 0.0, "x": 2.0})
    assert histograms == {"hist/weight/a.b": (0.0, 2.0, [1.0, 3.0])}
    assert scalars == {"hist/other": 1.0, "hist/weight/c/min": 0.0, "x": 2.0}
    scalars, histograms = _split_histograms({**full, "hist/weight/a.b/max": math.nan})
    assert histograms == {} and len(scalars) == 4
