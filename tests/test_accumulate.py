"""Gradient accumulation: ``tap.accumulate()`` per micro-batch, ``tap.step()`` per optimizer step.

Every value is compared with what ``.item()`` says in the same loop.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from tests.conftest import ListSink, classifier

MICRO = 4


def _micro_batches(step: int, sizes: tuple[int, ...] = (6, 4, 6, 5)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g)) for n in sizes]


def test_one_record_per_optimizer_step_with_exact_loss_accuracy_and_samples(sink: ListSink) -> None:
    model, opt = classifier()
    metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(), bt.metrics.LearningRate(opt), bt.metrics.GradNorm(model)]
    expected = []
    with bt.Tap(metrics, [sink], flush_every=3) as tap, tap.run():
        for step in range(7):
            weighted, samples, correct = 0.0, 0, 0
            for x, y in _micro_batches(step):
                out = model(x)
                loss = F.cross_entropy(out, y)
                (loss / MICRO).backward()  # nanoGPT-style scaling for backward only
                tap.accumulate(loss=loss, outputs=out, targets=y)
                weighted += loss.item() * len(y)
                samples += len(y)
                correct += (out.argmax(1) == y).sum().item()
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
            tap.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            expected.append((weighted / samples, correct / samples, norm))
    assert [r.step for r in sink.records] == list(range(7))
    for record, (loss, acc, norm) in zip(sink.records, expected):
        assert record.values["loss"] == pytest.approx(loss, rel=1e-6)
        assert record.values["accuracy"] == pytest.approx(acc, abs=1e-7)
        assert record.values["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert record.values["lr"] == 0.05
    assert not sink.events


def test_step_time_spans_every_micro_batch_and_throughput_counts_all_samples(sink: ListSink) -> None:
    sleep = 0.01
    metrics = [bt.metrics.Loss(), bt.metrics.StepTime(), bt.metrics.DataTime(), bt.metrics.Throughput()]
    loader = [torch.randn(4, 3) for _ in range(4 * MICRO)]
    with bt.Tap(metrics, [sink], flush_every=2) as tap, tap.run():
        for i, x in enumerate(tap.watch(loader)):
            time.sleep(sleep)  # the micro-batch's compute
            tap.accumulate(loss=x.square().mean(), batch_size=4, tokens=40)
            if i % MICRO == MICRO - 1:
                tap.step()
    assert len(sink.records) == 4
    for record in sink.records[1:]:  # the run's first step has no measured start
        # four micro-batches of >= 10 ms each: not one
        assert record.values["step_time"] >= MICRO * sleep
        # tokens (4 micro-batches x 40) per second of the whole step
        assert record.values["throughput"] == pytest.approx(4 * 40 / record.values["step_time"], rel=1e-9)
        assert record.values["data_time"] >= 0


def test_samples_and_tokens_of_all_micro_batches_reach_the_record() -> None:
    sink = ListSink()
    metrics = [bt.metrics.Loss(), bt.metrics.StepTime(), bt.metrics.Throughput()]
    with bt.Tap(metrics, [sink], flush_every=1) as tap, tap.run():
        for _ in range(3):
            for n in (3, 5):
                tap.accumulate(loss=torch.rand(()), batch_size=n)
            tap.step()
    for r in sink.records[1:]:
        assert r.values["throughput"] * r.values["step_time"] == pytest.approx(8.0)


def test_loss_is_the_sample_weighted_mean_of_the_unscaled_micro_losses(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.accumulate(loss=torch.tensor(1.0), batch_size=1)
        tap.accumulate(loss=torch.tensor(4.0), batch_size=3)
        tap.step()
        # unknown sizes (loss only, no batch_size): every micro-batch weighs the same
        tap.accumulate(loss=torch.tensor(1.0))
        tap.accumulate(loss=torch.tensor(4.0))
        tap.step()
    assert [r.values["loss"] for r in sink.records] == [pytest.approx(13 / 4), pytest.approx(2.5)]


def test_plain_steps_and_accumulated_steps_mix_in_one_run(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.step(loss=torch.tensor(2.0))
        tap.accumulate(loss=torch.tensor(1.0))
        tap.accumulate(loss=torch.tensor(3.0))
        tap.step()
        tap.step(loss=torch.tensor(5.0))
    assert [r.values["loss"] for r in sink.records] == [2.0, 2.0, 5.0]


def test_loss_passed_to_step_after_accumulate_is_a_clear_error(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.step(loss=torch.tensor(2.0))
        tap.accumulate(loss=torch.tensor(1.0))
        with pytest.raises(bt.InputError, match="pass every micro-batch .* to accumulate"):
            tap.step(loss=torch.tensor(1.0))
        tap.step()
    assert [r.values["loss"] for r in sink.records] == [2.0, 1.0]  # nothing recorded was lost


def test_nan_in_one_micro_batch_stops_training(sink: ListSink) -> None:
    with bt.Tap([bt.metrics.Loss()], [sink]) as tap, tap.run():
        tap.accumulate(loss=torch.tensor(1.0))
        tap.accumulate(loss=torch.tensor(math.nan))
        tap.step()
        assert tap.should_stop
    assert math.isnan(sink.records[0].values["loss"])


def test_no_host_read_in_accumulated_steps(sink: ListSink) -> None:
    model, opt = classifier()
    metrics = [
        bt.metrics.Loss(),
        bt.metrics.Accuracy(topk=(1, 3)),
        bt.metrics.LearningRate(opt),
        bt.metrics.GradNorm(model),
        bt.metrics.StepTime(),
        bt.metrics.Throughput(),
    ]
    with bt.Tap(metrics, [sink], flush_every=5, flush_seconds=1e-3) as tap, tap.run():
        for step in range(40):
            batches = _micro_batches(step)
            outs = [(model(x), y) for x, y in batches]
            losses = [F.cross_entropy(o, y) for o, y in outs]
            sum(losses).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step == 0:  # the run's first step allocates the ring: once per run
                for loss, (o, y) in zip(losses, outs):
                    tap.accumulate(loss=loss, outputs=o, targets=y)
                tap.step(extra={"clip": norm})
            else:
                with HostReadCounter() as reads:
                    for loss, (o, y) in zip(losses, outs):
                        tap.accumulate(loss=loss, outputs=o, targets=y)
                    tap.step(extra={"clip": norm})
                    tap.should_stop
                assert reads.count == 0, reads.reads
            opt.step()
            opt.zero_grad()
    assert len(sink.records) == 40
