"""``Tap.run_metrics``: the seam through which the Keras torch backend adds its per-output accuracy
to the open run (instead of reaching into the Tap's private run). What it promises: None without
an open run; metrics added to that run alone, before its first step; nothing added once a step
fixed the run's columns; the Tap's own list and its next run untouched; no reference cycle."""

from __future__ import annotations

import gc
import weakref

import torch

import batchtap as bt
from batchtap.integrations._keras_accuracy import HeadAccuracy
from batchtap.metrics.base import Metric


def _names(metrics: tuple[Metric, ...] | None) -> list[str]:
    assert metrics is not None
    return [o.name for m in metrics for o in m.outputs()]


def test_adds_to_the_open_run_alone_before_its_first_step() -> None:
    tap = bt.Tap([bt.metrics.Loss()], sinks=[])
    with tap:
        assert tap.run_metrics() is None and tap.run_metrics([HeadAccuracy("accuracy/a")]) is None
        head = HeadAccuracy("accuracy/a")
        with tap.run(name="first"):
            metrics = tap.run_metrics([head])
            assert _names(metrics) == ["loss", "accuracy/a"]
            assert tap.run_metrics() == metrics  # asking again adds nothing
            head.give(torch.tensor([[0.2, 0.8]]), torch.tensor([1]))
            tap.step(loss=torch.tensor(0.5))
            late = HeadAccuracy("accuracy/b")
            after = tap.run_metrics([late])  # the first step fixed the columns
            assert after is not None and all(m is not late for m in after)
        assert [type(m) for m in tap.metrics] == [bt.metrics.Loss]
        with tap.run(name="second"):
            assert _names(tap.run_metrics()) == ["loss"]  # not inherited


def test_holds_the_tap_weakly() -> None:
    tap = bt.Tap([bt.metrics.Loss()], sinks=[])
    tap.close()
    ref = weakref.ref(tap)
    seam = tap.run_metrics
    del tap
    gc.collect()
    assert ref() is None and seam() is None
