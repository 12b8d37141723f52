"""The other built-in metrics: learning rate per param group, throughput, combine declarations,
the default metric set."""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from batchtap.metrics import StepInputs, StepTiming
from tests.metrics._helpers import accumulated, raw, step

C, R = bt.metrics.Combine, bt.metrics.Reduce


def _opt(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.randn(2))], "lr": lr} for lr in lrs]
    return torch.optim.AdamW(groups)


@pytest.mark.parametrize(
    ("lrs", "expected"),
    [
        pytest.param((3e-4,), [3e-4], id="one-group"),
        pytest.param((3e-4, 3e-4, 3e-4), [3e-4, None, None], id="equal-groups"),
        pytest.param((3e-4, 3e-5, 3e-4), [3e-4, 3e-5, None], id="one-differs"),
    ],
)
def test_learning_rate_one_value_per_group_where_groups_differ(lrs, expected) -> None:
    metric = bt.metrics.LearningRate(_opt(*lrs))
    assert [o.name for o in metric.outputs()] == ["lr", *(f"lr_group{i}" for i in range(1, len(lrs)))]
    assert step(metric, StepInputs(None, None, None, 1.0)) == expected


def test_learning_rate_follows_a_scheduler_and_a_name() -> None:
    opt = _opt(1e-3, 1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0, lambda s: 0.5**s])
    metric = bt.metrics.LearningRate(opt, name="lr_g")
    assert [o.name for o in metric.outputs()] == ["lr_g", "lr_g_group1"]
    seen = []
    for _ in range(3):
        seen.append(step(metric, StepInputs(None, None, None, 1.0)))
        opt.step()
        sched.step()
    assert seen == [[1e-3, None], [1e-3, 5e-4], [1e-3, 2.5e-4]]


@pytest.mark.parametrize(
    ("timing", "expected"),
    [
        pytest.param(StepTiming(8.0, 0.5, math.nan), 16.0, id="samples"),
        pytest.param(StepTiming(8.0, 0.5, math.nan, tokens=8 * 1024.0), 16384.0, id="tokens"),
        pytest.param(StepTiming(math.nan, 0.5, math.nan, tokens=2048.0), 4096.0, id="tokens-no-samples"),
        pytest.param(StepTiming(math.nan, 0.5, math.nan), None, id="unknown-count"),
        pytest.param(StepTiming(8.0, math.nan, math.nan), None, id="unknown-time"),
        pytest.param(StepTiming(8.0, 0.0, math.nan), None, id="zero-time"),
        pytest.param(StepTiming(8.0, -1.0, math.nan), None, id="negative-time"),
    ],
)
def test_throughput(timing, expected) -> None:
    assert bt.metrics.Throughput().finalize([], timing) == [expected]


def test_loss_combines_as_a_sample_weighted_mean() -> None:
    metric = bt.metrics.Loss()
    assert metric.combine() == (C.MEAN,)
    g = torch.Generator().manual_seed(0)
    sizes = [3.0, 5.0, 8.0]
    losses = [torch.rand((), generator=g) * 4 for _ in sizes]
    got = metric.finalize(accumulated(metric, [StepInputs(l, None, None, n) for l, n in zip(losses, sizes)]), None)
    assert got[0] == pytest.approx(sum(l.item() * n for l, n in zip(losses, sizes)) / sum(sizes), rel=1e-6)


@pytest.mark.parametrize(
    ("reduce", "combine"),
    [(R.MEAN, C.MEAN), (R.SUM, C.SUM), (R.MAX, C.MAX), (R.MIN, C.MIN), (R.L2, C.MEAN)],
    ids=lambda v: v.value,
)
def test_custom_combines_as_it_reduces(reduce, combine) -> None:
    metric = bt.metrics.Custom("m", lambda outputs: outputs.abs().max(), requires=("outputs",), reduce=reduce)
    assert metric.combine() == (combine,)


def test_custom_max_over_micro_batches() -> None:
    metric = bt.metrics.Custom("peak", lambda outputs: outputs.abs().max(), requires=("outputs",), reduce=R.MAX)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 3, generator=g) for _ in range(3)]
    got = metric.finalize(accumulated(metric, [StepInputs(None, b, None, 4.0) for b in batches]), None)
    assert got[0] == pytest.approx(max(b.abs().max().item() for b in batches), rel=1e-6)


def test_default_metrics_with_mappings_and_a_scaler() -> None:
    g, d = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    opts = {"g": torch.optim.SGD(g.parameters(), lr=0.1), "d": torch.optim.SGD(d.parameters(), lr=0.2)}
    scaler = torch.amp.GradScaler("cpu")
    metrics = bt.metrics.default_metrics(opts, {"g": g, "d": d}, scaler=scaler)
    names = [o.name for m in metrics for o in m.outputs()]
    assert names == [
        "loss",
        "accuracy",
        "grad_norm_g",
        "grad_norm_d",
        "loss_scale",
        "amp_skipped",
        "lr_g",
        "lr_d",
        "step_time",
        "data_time",
        "throughput",
        "memory_allocated",
        "memory_peak",
    ]
    norms = [m for m in metrics if isinstance(m, bt.metrics.GradNorm)]
    assert all(m.scaler is scaler for m in norms)
    assert [m.parameters for m in norms] == [list(g.parameters()), list(d.parameters())]
    single = bt.metrics.default_metrics(opts["g"], g)
    assert [o.name for m in single for o in m.outputs()][:4] == ["loss", "accuracy", "grad_norm", "lr"]


def test_default_metrics_drop_accuracy_for_regression_and_loss_only_loops() -> None:
    metrics = bt.metrics.default_metrics()
    regression = StepInputs(torch.tensor(0.3), torch.randn(8, 1), torch.randn(8, 1), 8.0)
    loss_only = StepInputs(torch.tensor(0.3), None, None, math.nan)
    assert [type(m).__name__ for m in metrics if m.applies(regression)] == [
        "Loss",
        "StepTime",
        "DataTime",
        "Throughput",
        "Memory",
    ]
    assert [type(m).__name__ for m in metrics if m.applies(loss_only)] == [
        "Loss",
        "StepTime",
        "DataTime",
        "Throughput",
        "Memory",
    ]
    # and a loss-only loop's throughput is absent rather than NaN
    assert bt.metrics.Throughput().finalize([], StepTiming(math.nan, 0.1, math.nan)) == [None]


def test_no_metric_reads_the_device_in_compute() -> None:
    torch.manual_seed(2)
    model = torch.nn.Linear(6, 5)
    logits = model(torch.randn(2, 3, 6))
    targets = torch.randint(0, 5, (2, 3))
    targets[0, 0] = -100
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = bt.metrics.default_metrics(opt, model, scaler=torch.amp.GradScaler("cpu")) + [
        bt.metrics.Accuracy(topk=(1, 3)),
        bt.metrics.Custom("mean_logit", lambda outputs: outputs.mean(), requires=("outputs",)),
    ]
    inputs = StepInputs(loss.detach(), logits.detach(), targets, 2.0, grad_norm=torch.tensor(1.5))
    for metric in metrics:
        raw(metric, inputs)  # asserts no _local_scalar_dense inside compute, widths, 0-dim values


def test_a_missing_device_extra_is_one_reused_nan_tensor_per_device() -> None:
    # No allocation per step: the NaN placeholder of an absent extra is made once and reused.
    metric = bt.metrics.Extra("kl", on_device=True)
    absent = StepInputs(torch.tensor(1.0), None, None, 1.0)
    (first,) = metric.compute(absent)
    (second,) = metric.compute(absent)
    assert first is second and math.isnan(float(first)) and first.dtype == torch.float32
    assert metric.read_host(absent) == (0.0,)  # and flagged absent
    present = StepInputs(torch.tensor(1.0), None, None, 1.0, {"kl": torch.tensor(0.25)})
    assert [float(v) for v in metric.compute(present)] == [0.25] and metric.read_host(present) == (1.0,)
