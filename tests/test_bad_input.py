"""Each bad input gets an error naming what was expected, what arrived and the fix — and every step
recorded before it stays recorded."""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from tests.conftest import ListSink

METRICS = lambda: [bt.metrics.Loss(), bt.metrics.Accuracy(topk=(1, 2))]  # noqa: E731


def _good(tap: bt.Tap, n: int = 3) -> None:
    for i in range(n):
        out = torch.randn(8, 4)
        tap.step(loss=torch.tensor(0.5 + i), outputs=out, targets=out.argmax(1))


BAD_STEPS = [
    pytest.param(
        dict(loss=torch.ones(4)),
        r"loss must be a 0-dim tensor, got shape \(4,\); reduce it first",
        id="loss-not-scalar",
    ),
    pytest.param(
        dict(loss=0.5),
        r"loss must be a 0-dim floating-point tensor, got float; pass the loss tensor itself",
        id="loss-python-float",
    ),
    pytest.param(
        dict(loss=torch.tensor(1)), r"loss must be a floating-point tensor, got dtype torch.int64", id="loss-int"
    ),
    pytest.param(dict(loss=torch.tensor(True)), r"floating-point tensor, got dtype torch.bool", id="loss-bool"),
    pytest.param(
        dict(outputs=torch.randn(8, 4), targets=torch.zeros(6, dtype=torch.long)),
        r"outputs and targets disagree on batch size: 8 vs 6",
        id="batch-mismatch",
    ),
    pytest.param(
        dict(outputs=torch.randn(8, 4), targets=torch.zeros(8, 4)),
        r"integer class indices as targets, got float32 targets: for regression leave Accuracy out",
        id="float-targets",
    ),
    pytest.param(
        dict(outputs=torch.randn(8), targets=torch.zeros(8, dtype=torch.long)),
        r"class scores of shape \[N, C\].*got shape \(8,\)",
        id="outputs-1d",
    ),
    pytest.param(
        dict(outputs=torch.randn(8, 1), targets=torch.zeros(8, dtype=torch.long)),
        r"needs at least 2 classes, outputs have 1",
        id="topk-too-large",
    ),
    pytest.param(
        dict(outputs=None, targets=None),
        r"Accuracy needs outputs, targets, but step\(\) got none",
        id="targets-missing",
    ),
    pytest.param(
        dict(outputs=torch.randn(8, 4, device="meta"), targets=torch.zeros(8, dtype=torch.long, device="meta")),
        r"outputs is on meta but this run captures on cpu; move it",
        id="other-device",
    ),
    pytest.param(
        dict(extra={"loss": torch.tensor(1.0)}),
        r"extra 'loss' was not present at the run's first step",
        id="extra-new-name",
    ),
    pytest.param(dict(batch_size=0), r"batch_size must be a positive integer, got 0", id="bad-batch-size"),
]


@pytest.mark.parametrize(("change", "message"), BAD_STEPS)
def test_bad_step_input_raises_clearly_and_keeps_earlier_steps(change, message) -> None:
    sink = ListSink()
    with bt.Tap(METRICS(), [sink]) as tap:
        with tap.run():
            _good(tap)
            out = torch.randn(8, 4)
            kwargs = dict(loss=torch.tensor(1.0), outputs=out, targets=out.argmax(1))
            kwargs.update(change)
            with pytest.raises(bt.InputError, match=message):
                tap.step(**kwargs)
            _good(tap, 1)  # the run goes on after a caught error
    assert [r.values["loss"] for r in sink.records] == [0.5, 1.5, 2.5, 0.5]
    assert [r.step for r in sink.records] == [0, 1, 2, 3]


def test_extra_clashing_with_a_builtin_at_the_first_step() -> None:
    with bt.Tap(METRICS(), [ListSink()]) as tap, tap.run():
        out = torch.randn(8, 4)
        with pytest.raises(
            bt.InputError, match=r"extra 'accuracy' clashes with a built-in .* rename it, e.g. 'extra_accuracy'"
        ):
            tap.step(loss=torch.tensor(1.0), outputs=out, targets=out.argmax(1), extra={"accuracy": 0.3})
        with pytest.raises(bt.InputError, match="clashes"):
            tap.step(loss=torch.tensor(1.0), outputs=out, targets=out.argmax(1), extra={"step": 1.0})


def test_extra_changing_kind_is_rejected() -> None:
    with bt.Tap([bt.metrics.Loss()], [ListSink()]) as tap, tap.run():
        tap.step(loss=torch.tensor(1.0), extra={"kl": torch.tensor(0.1)})
        with pytest.raises(bt.InputError, match="arrived as float but was a tensor at its first step"):
            tap.step(loss=torch.tensor(1.0), extra={"kl": 0.1})
        with pytest.raises(bt.InputError, match=r"must be a real 0-dim tensor, got shape \(3,\)"):
            tap.step(loss=torch.tensor(1.0), extra={"kl": torch.ones(3)})


def test_class_indices_out_of_range_raise_at_a_following_step_and_store_nan() -> None:
    sink = ListSink()
    metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(topk=(1, 2), check_targets_every=1)]
    with bt.Tap(metrics, [sink], flush_every=1) as tap:
        with pytest.raises(
            bt.InputError,
            match=r"step 3: targets hold class indices outside \[0, 4\) \(smallest -1, largest 4\) for outputs with 4 classes",
        ):
            with tap.run():
                _good(tap)
                out = torch.randn(8, 4)
                targets = out.argmax(1)
                targets[0], targets[5] = 4, -1
                tap.step(loss=torch.tensor(9.0), outputs=out, targets=targets)
                for _ in range(100):  # the error surfaces once the row reached the host
                    tap.flush()
                    _good(tap, 1)
    losses = [r.values["loss"] for r in sink.records]
    assert losses[:4] == [0.5, 1.5, 2.5, 9.0]
    assert math.isnan(sink.records[3].values["accuracy"]) and math.isnan(sink.records[3].values["accuracy_top2"])
    assert {e.metric for e in sink.events if e.step == 3} == {"accuracy", "accuracy_top2"}
    assert sink.ended[0].status is bt.RunStatus.FAILED


@pytest.mark.parametrize(
    ("bad", "smallest", "largest"),
    [pytest.param(4, 0, 4, id="target-equal-to-classes"), pytest.param(-1, -1, 3, id="target-minus-1")],
)
def test_each_target_boundary_alone_raises_through_the_tap(bad: int, smallest: int, largest: int) -> None:
    # One bad index per test, next to the valid extremes 0 and C - 1: neither check can hide
    # behind the other (a batch holding -1 and C at once lets a weakened upper check pass).
    sink = ListSink()
    metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(check_targets_every=1)]
    expected = (
        rf"step 3: targets hold class indices outside \[0, 4\) \(smallest {smallest}, largest {largest}\) "
        "for outputs with 4 classes"
    )
    with bt.Tap(metrics, [sink], flush_every=1) as tap:
        with pytest.raises(bt.InputError, match=expected):
            with tap.run():
                _good(tap)
                out = torch.randn(8, 4)
                targets = torch.tensor([0, 3, 1, 2, 0, 3, 1, 2])
                targets[4] = bad
                tap.step(loss=torch.tensor(9.0), outputs=out, targets=targets)
                for _ in range(100):  # the error surfaces once the row reached the host
                    tap.flush()
                    _good(tap, 1)
    assert [r.values["loss"] for r in sink.records][:4] == [0.5, 1.5, 2.5, 9.0]  # nothing recorded is lost
    assert math.isnan(sink.records[3].values["accuracy"])
    assert all(0.0 <= r.values["accuracy"] <= 1.0 for r in sink.records[:3])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(dict(flush_every=0), r"flush_every must be an integer >= 1, got 0", id="flush-every-0"),
        pytest.param(
            dict(flush_every=10, capacity=15),
            r"capacity must be >= 2 \* flush_every = 20 .* got 15; raise capacity",
            id="ring-too-small",
        ),
        pytest.param(dict(sample_every=0), r"sample_every must be an integer >= 1, got 0", id="sample-every-0"),
        pytest.param(dict(flush_seconds=0), r"flush_seconds must be > 0, got 0", id="flush-seconds-0"),
        pytest.param(
            dict(metrics=[bt.metrics.Loss(), bt.metrics.Loss()]),
            r"'loss' is used twice or reserved",
            id="duplicate-metric",
        ),
        pytest.param(
            dict(metrics=["loss"]),
            r"metrics\[0\] must be a batchtap.metrics.Metric object, got 'loss'; fix: ",
            id="metric-not-object",
        ),
        pytest.param(
            dict(
                extras={"lr": "tensor"},
                metrics=[bt.metrics.LearningRate(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0))],
            ),
            r"extra 'lr' clashes",
            id="extra-clash-declared",
        ),
        pytest.param(
            dict(extras={"kl": "vector"}),
            r"extras kind for 'kl' must be 'tensor' or 'number', got 'vector'",
            id="extra-kind",
        ),
        pytest.param(
            dict(backpressure="wait"), r"backpressure must be 'block' or 'drop_oldest', got 'wait'", id="backpressure"
        ),
    ],
)
def test_bad_configuration_fails_at_construction(kwargs, message) -> None:
    with pytest.raises(bt.ConfigError, match=message):
        bt.Tap(sinks=[], **kwargs)


def test_bad_metric_configuration() -> None:
    with pytest.raises(bt.ConfigError, match=r"topk must be positive and contain 1, got \(0, 5\)"):
        bt.metrics.Accuracy(topk=(0, 5))
    with pytest.raises(bt.ConfigError, match="GradNorm got no parameters"):
        bt.metrics.GradNorm([])
    with pytest.raises(bt.ConfigError, match="LearningRate needs a torch.optim.Optimizer, got dict"):
        bt.metrics.LearningRate({})


def test_run_config_that_json_cannot_hold_is_stored_as_repr_with_a_warning() -> None:
    # Issue 11: everyday config objects are stored, never a raw TypeError; what JSON cannot hold is
    # stored as its repr and named in a warning event.
    sink = ListSink()
    with bt.Tap(sinks=[sink]) as tap:
        with tap.run(config={"model": object(), "lr": 0.1}) as info:
            pass
    assert info.config["lr"] == 0.1 and info.config["model"].startswith("<object object")
    assert any(e.kind is bt.EventKind.WARNING and "model" in e.message for e in sink.events)


def test_run_config_that_is_not_a_mapping_is_refused() -> None:
    with bt.Tap(sinks=[]) as tap:
        with pytest.raises(bt.ConfigError, match="config must be a mapping, an argparse.Namespace or a dataclass"):
            with tap.run(config=[("lr", 0.1)]):
                pass
