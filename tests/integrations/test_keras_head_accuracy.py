"""The torch backend's per-output accuracy (``accuracy/<head>``) is an accuracy of the run, not a
plain extra: held to [0, 1] (a value outside is an anomaly), weighted by the head's counted targets
across ranks, higher is better, absent where a head had no class targets, with no host read.

Keras is not needed here: the metric goes through a real Tap and SQLite store as the torch
backend's recorder drives it; its values against Keras' own per-batch accuracy are held in
test_keras_backends.py (dict and list outputs, both pipelines).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import batchtap as bt
import batchtap.store
from batchtap.hostreads import HostReadCounter
from batchtap.integrations._keras_accuracy import HeadAccuracy, head_accuracies

SCORES = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
TARGETS = torch.tensor([0, 1, 1, 1])  # 3 of 4 right


def test_declared_as_batchtaps_accuracy() -> None:
    (mine,) = HeadAccuracy("accuracy/a").outputs()
    (theirs,) = bt.metrics.Accuracy().outputs()
    assert mine.name == "accuracy/a"
    assert (mine.domain, mine.reduce, mine.weight, mine.higher_is_better) == (
        theirs.domain,
        theirs.reduce,
        theirs.weight,
        theirs.higher_is_better,
    )
    # across ranks: the mean weighted by each rank's counted targets (3/4 and 1/1 -> 4/5, not 0.875)
    decoding = HeadAccuracy("accuracy/a").decoder()
    raw = np.array([[3.0, 4.0], [1.0, 1.0]])
    values, _ = decoding.finalize_block(raw, None)
    weights = decoding.weight_block(raw)
    assert weights is not None
    assert float(np.sum(values[:, 0] * weights) / np.sum(weights)) == pytest.approx(0.8)


def test_stored_as_an_accuracy_of_the_run_out_of_domain_is_an_anomaly(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    tap = bt.Tap([bt.metrics.Loss()], [bt.sinks.SQLite(db)], nan_guard=False)
    with tap, tap.run(name="heads"):
        heads = head_accuracies(tap, ("a", "b"))
        assert heads is not None and set(heads) == {"a", "b"}
        heads["a"].give(SCORES, TARGETS)
        heads["b"].give(SCORES, torch.tensor([1, 0, 1, 1]))  # 1 of 4
        tap.step(loss=torch.tensor(1.0))
        heads["a"].give(SCORES, TARGETS)  # head b had no class targets this step: absent
        tap.step(loss=torch.tensor(1.0))
        # a planted wrong count: 5 hits of 4 targets, accuracy 1.25
        heads["a"].compute = lambda inputs: (torch.tensor(5.0), torch.tensor(4.0))  # type: ignore[method-assign]
        tap.step(loss=torch.tensor(1.0))
        again = head_accuracies(tap, ("a", "b"))  # a second fit() in the same run finds them
        assert again is not None and again["a"] is heads["a"]
    assert [type(m) for m in tap.metrics] == [bt.metrics.Loss]  # the Tap's own list is left as it was
    with batchtap.store.open(db) as store:
        (run,) = store.runs()
        a = [(p.step, p.value) for p in store.series(run.id, "accuracy/a")]
        b = [(p.step, p.value) for p in store.series(run.id, "accuracy/b")]
        events = store.events(run.id)
    assert a[:2] == [(0, 0.75), (1, 0.75)]
    assert b == [(0, 0.25)]
    anomalies = [(e.step, e.metric) for e in events if e.kind is bt.EventKind.ANOMALY]
    assert anomalies == [(2, "accuracy/a")], events


def test_counted_on_the_device_with_no_host_read() -> None:
    acc = HeadAccuracy("accuracy/a")
    inputs = bt.metrics.StepInputs(None, None, None, 4.0, device=torch.device("cpu"))
    with HostReadCounter() as reads:
        acc.give(SCORES, TARGETS)
        counted = acc.compute(inputs)
        absent = acc.compute(inputs)  # nothing given: nothing counted
    assert reads.count == 0, reads.reads
    assert [float(v) for v in counted] == [3.0, 4.0] and [float(v) for v in absent] == [0.0, 0.0]


def test_a_run_that_recorded_steps_without_them_keeps_plain_extras() -> None:
    tap = bt.Tap([bt.metrics.Loss()], [], nan_guard=False)
    with tap, tap.run(name="late"):
        tap.step(loss=torch.tensor(1.0))
        assert head_accuracies(tap, ("a",)) is None
