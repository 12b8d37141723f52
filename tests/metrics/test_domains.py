"""Every built-in metric's domain and reduction, stated once, and enforced at the boundaries.

The domain is what the decoder validates against (a value outside it is stored as NaN with an
anomaly event that keeps the raw value), and the reduction is how ranks combine it. A change to
either is a change of meaning, so both are spelled out here value by value.
"""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from batchtap.metrics import ANY_FINITE, NONNEGATIVE, UNIT_INTERVAL, Domain, Reduce
from tests.conftest import ListSink

INF = math.inf


def _all_builtin_metrics() -> list[bt.metrics.Metric]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    return [
        bt.metrics.Loss(),
        bt.metrics.Accuracy(topk=(1, 3)),
        bt.metrics.LearningRate(optimizer),
        bt.metrics.GradNorm(model),
        bt.metrics.GradNorm(model, name="shard_norm", sharded=True),
        bt.metrics.LossScale(scaler),
        bt.metrics.StepTime(),
        bt.metrics.DataTime(),
        bt.metrics.Throughput(),
        bt.metrics.Memory(),
        bt.metrics.Extra("kl", on_device=True),
    ]


#: name -> (low, high, finite, reduce)
STATED = {
    "loss": (0.0, INF, True, Reduce.MEAN),
    "accuracy": (0.0, 1.0, True, Reduce.MEAN),
    "accuracy_top3": (0.0, 1.0, True, Reduce.MEAN),
    "lr": (0.0, INF, True, Reduce.MAX),
    "grad_norm": (0.0, INF, True, Reduce.MAX),
    "shard_norm": (0.0, INF, True, Reduce.L2),
    "loss_scale": (0.0, INF, True, Reduce.MAX),
    "amp_skipped": (0.0, 1.0, True, Reduce.MAX),
    "step_time": (0.0, INF, True, Reduce.MAX),
    "data_time": (0.0, INF, True, Reduce.MAX),
    "throughput": (0.0, INF, True, Reduce.SUM),
    "memory_allocated": (0.0, INF, True, Reduce.MAX),
    "memory_peak": (0.0, INF, True, Reduce.MAX),
    "kl": (-INF, INF, True, Reduce.MEAN),
}


def test_every_builtin_output_has_its_stated_domain_and_reduction() -> None:
    got = {
        o.name: (o.domain.low, o.domain.high, o.domain.finite, o.reduce)
        for m in _all_builtin_metrics()
        for o in m.outputs()
    }
    assert got == STATED


def test_loss_may_be_declared_signed() -> None:
    (out,) = bt.metrics.Loss(nonnegative=False).outputs()
    assert out.domain == ANY_FINITE and out.reduce is Reduce.MEAN


@pytest.mark.parametrize(
    ("domain", "inside", "outside"),
    [
        pytest.param(UNIT_INTERVAL, [0.0, 0.5, 1.0], [-1e-9, 1.0 + 1e-9, INF, -INF, math.nan], id="unit-interval"),
        pytest.param(NONNEGATIVE, [0.0, 1e300], [-1e-300, INF, math.nan], id="nonnegative"),
        pytest.param(ANY_FINITE, [-1e300, 0.0, 1e300], [INF, -INF, math.nan], id="any-finite"),
        pytest.param(Domain(low=0.0, finite=False), [0.0, INF], [-INF, -1.0, math.nan], id="nonnegative-with-inf"),
    ],
)
def test_domain_boundaries_are_closed_and_nan_is_never_inside(
    domain: Domain, inside: list[float], outside: list[float]
) -> None:
    assert [domain.violation(v) for v in inside] == [None] * len(inside)
    assert all(domain.violation(v) is not None for v in outside)


def test_domain_messages_and_descriptions() -> None:
    assert UNIT_INTERVAL.violation(-0.5) == "below its minimum 0"
    assert UNIT_INTERVAL.violation(1.5) == "above its maximum 1"
    assert UNIT_INTERVAL.violation(math.nan) == "not a number"
    assert NONNEGATIVE.violation(INF) == "not finite"
    assert UNIT_INTERVAL.describe() == "[0, 1] (finite)"
    assert Domain(finite=False).describe() == "[-inf, inf]"
    with pytest.raises(ValueError, match="Domain needs low <= high, got low=1.0 high=0.0"):
        Domain(low=1.0, high=0.0)
    assert Domain(low=1.0, high=1.0).violation(1.0) is None  # a single point is a domain


def test_an_accuracy_above_one_is_stored_as_nan_with_its_raw_value_in_an_anomaly() -> None:
    # A Custom metric with accuracy's own domain: the decoder enforces the declared interval, so
    # a value just above 1 (the "accuracy 103 %" symptom) never reaches a sink as a number.
    sink = ListSink()
    metric = bt.metrics.Custom("fraction", lambda loss: loss, requires=("loss",), domain=UNIT_INTERVAL)
    with bt.Tap([metric], [sink], flush_every=1) as tap, tap.run():
        for v in (0.0, 1.0, 1.03, 0.5):
            tap.step(loss=torch.tensor(v))
    values = sink.values("fraction")
    assert values[0] == 0.0 and values[1] == 1.0 and values[3] == 0.5
    assert math.isnan(values[2])
    (event,) = [e for e in sink.events if e.kind is bt.EventKind.ANOMALY]
    assert event.step == 2 and event.metric == "fraction" and "above its maximum 1" in event.message
    assert event.raw_value == pytest.approx(1.03, rel=1e-6)
