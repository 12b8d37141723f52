"""End-to-end behaviour of the Tap on the CPU: exact values, sampling, flushing, stopping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from batchtap.records import EventKind, RunStatus
from tests.conftest import ListSink, classifier


def _batch(n: int = 16, features: int = 8, classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, features), torch.randint(0, classes, (n,))


def _train(tap: bt.Tap, steps: int, *, topk=(1,), loss_scale: float = 1.0) -> dict[int, dict[str, float]]:
    """Run ``steps`` real SGD steps through ``tap`` and return reference values per global step."""
    model, opt = classifier()
    reference: dict[int, dict[str, float]] = {}
    for step in range(steps):
        x, y = _batch(n=int(torch.randint(4, 33, ()).item()))
        out = model(x)
        loss = F.cross_entropy(out, y) * loss_scale
        opt.zero_grad()
        loss.backward()
        opt.step()
        tap.step(loss=loss, outputs=out, targets=y)
        ref = {"loss": loss.float().item()}
        top = out.topk(max(topk), dim=1).indices
        for k in topk:
            name = "accuracy" if k == 1 else f"accuracy_top{k}"
            ref[name] = (top[:, :k] == y[:, None]).any(1).float().mean().item()
        reference[step] = ref
    return reference


def _assert_exact(records, reference) -> None:
    assert records, "nothing recorded"
    for r in records:
        for name, expected in reference[r.step].items():
            got = r.values[name]
            assert np.float32(got) == np.float32(expected), (r.step, name, got, expected)


@pytest.mark.parametrize(
    ("flush_every", "capacity", "flush_seconds", "steps"),
    [
        pytest.param(5, 10, 60.0, 137, id="wraps-around-13x"),
        pytest.param(50, 100, 60.0, 30, id="single-final-flush"),
        pytest.param(8, 16, 1e-6, 60, id="time-based-flushes"),
    ],
)
def test_recorded_values_equal_item_reference(sink: ListSink, flush_every, capacity, flush_seconds, steps) -> None:
    metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(topk=(1, 3)), bt.metrics.StepTime()]
    with bt.Tap(metrics, [sink], flush_every=flush_every, capacity=capacity, flush_seconds=flush_seconds) as tap:
        with tap.run(name="exact"):
            reference = _train(tap, steps, topk=(1, 3))
    assert [r.step for r in sink.records] == list(range(steps))
    _assert_exact(sink.records, reference)
    assert not sink.events
    assert all(r.values["step_time"] >= 0 for r in sink.records[1:])


def test_sample_every_records_every_nth_and_last_batch_of_epoch(sink: ListSink) -> None:
    model, opt = classifier()
    data = [_batch() for _ in range(23)]
    reference = {}
    with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=3, sample_every=5) as tap:
        with tap.run():
            step = 0
            for epoch in range(2):
                for x, y in tap.watch(data, epoch=epoch):
                    out = model(x)
                    loss = F.cross_entropy(out, y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    tap.step(loss=loss, outputs=out, targets=y)
                    reference[step] = {"loss": loss.item(), "accuracy": (out.argmax(1) == y).float().mean().item()}
                    step += 1
    got = [(r.epoch, r.batch) for r in sink.records]
    expected = [(e, b) for e in range(2) for b in (0, 5, 10, 15, 20, 22)]
    assert got == expected
    assert [r.step for r in sink.records] == [e * 23 + b for e, b in expected]
    _assert_exact(sink.records, reference)


def test_sample_every_without_len_uses_lookahead_for_last_batch(sink: ListSink) -> None:
    data = [_batch() for _ in range(7)]
    with bt.Tap([bt.metrics.Loss()], [sink], sample_every=3) as tap, tap.run():
        for x, _ in tap.watch(iter(data)):
            tap.step(loss=x.pow(2).mean())
    assert [r.batch for r in sink.records] == [0, 3, 6]


def test_watch_times_the_data_wait_and_counts_batches(sink: ListSink) -> None:
    import time

    def slow_loader():
        for _ in range(4):
            time.sleep(0.02)
            yield _batch()

    with bt.Tap(
        [bt.metrics.Loss(), bt.metrics.DataTime(), bt.metrics.StepTime(), bt.metrics.Throughput()], [sink]
    ) as tap:
        with tap.run():
            for epoch in range(2):
                for x, _ in tap.watch(slow_loader()):
                    tap.step(loss=x.mean().abs(), batch_size=16)
    assert [(r.epoch, r.batch) for r in sink.records] == [(e, b) for e in range(2) for b in range(4)]
    assert all(r.values["data_time"] >= 0.015 for r in sink.records)
    timed = [r for r in sink.records if "step_time" in r.values]
    assert len(timed) == 7  # the first step of a run has no measured start
    for r in timed:
        assert r.values["throughput"] == pytest.approx(16 / r.values["step_time"])


def test_nan_loss_sets_should_stop_within_two_steps(sink: ListSink) -> None:
    k = 17
    model, opt = classifier()
    seen_at = None
    with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [sink], flush_every=50) as tap:
        with tap.run() as run:
            for step in range(40):
                x, y = _batch()
                out = model(x)
                loss = F.cross_entropy(out, y)
                if step == k:
                    loss = loss * math.nan
                tap.step(loss=loss, outputs=out, targets=y)
                if tap.should_stop:
                    seen_at = step
                    break
    assert seen_at is not None and seen_at <= k + 2
    assert tap.stop_reason == f"non-finite loss nan at step {k}"
    assert sink.ended[0].status is RunStatus.STOPPED and sink.ended[0].id == run.id
    assert [r.step for r in sink.records] == list(range(seen_at + 1))  # nothing lost on stop
    assert math.isnan(sink.records[k].values["loss"])
    kinds = {(e.kind, e.metric) for e in sink.events}
    assert (EventKind.ACTION, "loss") in kinds and (EventKind.ANOMALY, "loss") in kinds


def test_nan_guard_off_keeps_training(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink], nan_guard=False) as tap, tap.run():
        for step in range(5):
            tap.step(loss=torch.tensor(math.nan if step == 1 else 1.0))
            assert not tap.should_stop
    assert tap.anomaly_counts == {"loss": 1}


@pytest.mark.parametrize(
    ("metric", "value", "why"),
    [
        pytest.param(
            bt.metrics.Custom("frac", lambda loss: loss, requires=("loss",), domain=bt.metrics.UNIT_INTERVAL),
            1.25,
            "above its maximum 1",
            id="accuracy-like-above-1",
        ),
        pytest.param(
            bt.metrics.Custom("frac", lambda loss: loss, requires=("loss",), domain=bt.metrics.UNIT_INTERVAL),
            -0.5,
            "below its minimum 0",
            id="below-0",
        ),
        pytest.param(
            bt.metrics.Custom("frac", lambda loss: loss, requires=("loss",)), math.inf, "not finite", id="inf"
        ),
    ],
)
def test_out_of_domain_values_become_nan_with_raw_value_in_event(sink, metric, value, why) -> None:
    with bt.Tap([metric], [sink]) as tap, tap.run():
        tap.step(loss=torch.tensor(0.5))
        tap.step(loss=torch.tensor(value))
        tap.step(loss=torch.tensor(0.25))
    assert [r.values["frac"] for r in sink.records][::2] == [0.5, 0.25]
    assert math.isnan(sink.records[1].values["frac"])
    (event,) = sink.events
    assert event.kind is EventKind.ANOMALY and event.step == 1 and event.metric == "frac"
    assert event.raw_value == value and why in event.message
    assert tap.anomaly_counts == {"frac": 1}


def test_negative_loss_is_an_anomaly_unless_allowed(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.step(loss=torch.tensor(-0.1))
    assert math.isnan(sink.records[0].values["loss"]) and sink.events[0].raw_value == pytest.approx(-0.1)
    other = ListSink()
    with bt.Tap([bt.metrics.Loss(nonnegative=False)], [other]) as tap, tap.run():
        tap.step(loss=torch.tensor(-0.1))
    assert other.records[0].values["loss"] == pytest.approx(-0.1) and not other.events


def test_extras_tensor_and_number_and_absent_steps(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink], extras={"temp": "number"}) as tap, tap.run():
        tap.step(loss=torch.tensor(1.0), extra={"kl": torch.tensor(0.5, dtype=torch.float16), "temp": 2})
        tap.step(loss=torch.tensor(1.0), extra={"temp": 3.5})
        tap.step(loss=torch.tensor(1.0), extra={"kl": torch.tensor(0.25)})
    assert [dict(r.values) for r in sink.records] == [
        {"loss": 1.0, "kl": 0.5, "temp": 2.0},
        {"loss": 1.0, "temp": 3.5},
        {"loss": 1.0, "kl": 0.25},
    ]
    assert not sink.events


def test_user_defined_metric_with_domain_and_reduction(sink: ListSink) -> None:
    mae = bt.metrics.Custom(
        "mae",
        lambda outputs, targets: (outputs - targets).abs().mean(),
        domain=bt.metrics.NONNEGATIVE,
        reduce=bt.metrics.Reduce.MEAN,
    )
    x, y = torch.randn(10, 3), torch.randn(10, 3)
    with bt.Tap([mae], [sink]) as tap, tap.run():
        tap.step(outputs=x, targets=y)
    assert np.float32(sink.records[0].values["mae"]) == np.float32((x - y).abs().mean().item())


def test_lr_gradnorm_and_defaults(sink: ListSink) -> None:
    model, opt = classifier()
    with bt.Tap(sinks=[sink], optimizer=opt, model=model) as tap, tap.run():
        x, y = _batch()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        tap.step(loss=loss, outputs=out, targets=y)
        expected_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        opt.param_groups[0]["lr"] = 0.01
        tap.step(loss=loss, outputs=out, targets=y)
        with pytest.raises(bt.InputError, match="Accuracy needs outputs, targets, but step"):
            tap.step(loss=loss)  # the run's first step fixed accuracy as one of its metrics
    first, second = sink.records
    assert first.values["lr"] == 0.05 and second.values["lr"] == 0.01
    assert first.values["grad_norm"] == pytest.approx(expected_norm, rel=1e-6)
    assert set(first.values) >= {"loss", "accuracy", "lr", "grad_norm"}


def test_exiting_by_exception_or_interrupt_stores_every_step(sink: ListSink) -> None:
    for error, status in ((RuntimeError("boom"), RunStatus.FAILED), (KeyboardInterrupt(), RunStatus.STOPPED)):
        sink.records.clear()
        with bt.Tap([bt.metrics.Loss()], [sink], flush_every=50) as tap:
            with pytest.raises(type(error)):
                with tap.run():
                    for i in range(33):
                        tap.step(loss=torch.tensor(float(i)))
                    raise error
        assert [r.values["loss"] for r in sink.records] == [float(i) for i in range(33)]
        assert sink.ended[-1].status is status
    assert sink.ended[0].stop_reason == "RuntimeError: boom"


def test_step_outside_run_and_nested_runs_are_errors() -> None:
    with bt.Tap(sinks=[]) as tap:
        with pytest.raises(bt.RunStateError, match=r"outside a run; wrap the training loop in `with tap.run"):
            tap.step(loss=torch.tensor(1.0))
        with pytest.raises(bt.RunStateError, match="outside a run"):
            tap.watch([1, 2])
        with tap.run(name="outer"):
            with pytest.raises(bt.RunStateError, match="'outer' is still active"):
                with tap.run():
                    pass


def test_two_runs_on_one_tap_restart_the_step_count(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap:
        for _ in range(2):
            with tap.run():
                for i in range(3):
                    tap.step(loss=torch.tensor(float(i)))
    assert [r.step for r in sink.records] == [0, 1, 2, 0, 1, 2]
    assert len({r.run_id for r in sink.records}) == 2
    assert sink.closed


def test_cpu_autocast_bf16_matches_fp32_reference(sink: ListSink) -> None:
    model, opt = classifier(features=16, classes=10)
    reference = {}
    with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy(topk=(1, 5))], [sink], flush_every=4) as tap, tap.run():
        for step in range(12):
            x, y = _batch(n=64, features=16, classes=10)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
                loss = F.cross_entropy(out, y)
                assert out.dtype == torch.bfloat16
                tap.step(loss=loss, outputs=out, targets=y)  # called under autocast on purpose
            opt.zero_grad()
            loss.backward()
            opt.step()
            top = out.float().topk(5, dim=1).indices
            reference[step] = {
                "loss": loss.float().item(),
                "accuracy": (top[:, 0] == y).float().mean().item(),
                "accuracy_top5": (top == y[:, None]).any(1).float().mean().item(),
            }
    for r in sink.records:
        for name, expected in reference[r.step].items():
            assert r.values[name] == pytest.approx(expected, abs=1 / 64 + 1e-6)


def test_metrics_callback_keeps_recipe_interface(capsys) -> None:
    model, opt = classifier()
    with bt.MetricsCallback(batch_size=16, print_every=2) as callback:
        for batch in range(5):
            x, y = _batch()
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            callback(0, batch, loss, out, y)
        rows = callback.batch_metrics
    assert [(m["epoch"], m["batch"]) for m in rows] == [(0, b) for b in range(5)]
    assert all({"loss", "accuracy"} <= set(m) for m in rows)
    err = capsys.readouterr().err
    assert "epoch 0 batch 2: loss=" in err and "acc=" in err and "epoch 0 batch 1:" not in err
