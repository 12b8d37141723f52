"""Rules driven by a real Tap: stop, raise, rollback with skipped batches, adaptive batch size."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import batchtap as bt
from batchtap.records import EventKind, RunStatus
from batchtap.rules import NonFinite, Spike, Threshold
from tests.conftest import ListSink, classifier


def _batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8), torch.randint(0, 5, (n,))


@pytest.mark.parametrize("k", [0, 5, 33], ids=["first-step", "early", "after-flushes"])
def test_nan_at_step_k_stops_by_k_plus_2_through_the_rule(k: int) -> None:
    sink = ListSink()
    model, opt = classifier()
    stopped_at = None
    tap = bt.Tap([bt.metrics.Loss()], [sink], rules=[NonFinite("loss", action="stop")], flush_every=10)
    with tap, tap.run():
        for step in range(60):
            x, y = _batch()
            loss = F.cross_entropy(model(x), y)
            if step == k:
                loss = loss * math.nan
            tap.step(loss=loss)
            if tap.should_stop:
                stopped_at = step
                break
    assert stopped_at is not None and stopped_at <= k + 2
    assert "nonfinite(loss)" in tap.stop_reason
    assert sink.ended[0].status is RunStatus.STOPPED and "nonfinite(loss)" in sink.ended[0].stop_reason
    assert [r.step for r in sink.records] == list(range(stopped_at + 1))


def test_threshold_stop_ends_the_run_as_stopped_with_the_reason() -> None:
    sink = ListSink()
    rule = Threshold("accuracy", below=0.5, patience=3, action="stop")
    with bt.Tap([bt.metrics.Accuracy()], [sink], rules=[rule], flush_every=2) as tap, tap.run():
        for step in range(200):
            out = torch.randn(10, 4)
            tap.step(outputs=out, targets=(out.argmax(1) + 1) % 4)  # always wrong: accuracy 0
            if tap.should_stop:
                break
            if step % 2 == 1:
                tap.flush()  # wait until the pipeline thread ran the rule on the block just flushed
    # The rule fires at the third record (patience 3), in the block of steps 2-3 flushed at step 3;
    # the flush above makes its decision arrive before step 4, which applies it: the loop stops there.
    assert step == 4
    assert sink.ended[0].status is RunStatus.STOPPED and "threshold(accuracy<0.5)" in sink.ended[0].stop_reason
    actions = [e for e in sink.events if e.kind is EventKind.ACTION]
    assert actions and "stop requested" in actions[0].message


def test_raise_action_raises_training_diverged_and_stores_everything() -> None:
    sink = ListSink()
    with bt.Tap([bt.metrics.Loss()], [sink], rules=[NonFinite(action="raise")], flush_every=50) as tap:
        with pytest.raises(bt.TrainingDiverged) as info:
            with tap.run():
                for step in range(20):
                    tap.step(loss=torch.tensor(math.inf if step == 6 else 1.0))
    assert info.value.step == 6 and info.value.metric == "loss"
    assert len(sink.records) == 7 and sink.ended[0].status is RunStatus.FAILED


def test_scripted_divergence_rolls_back_skips_batches_and_finishes_finite() -> None:
    torch.manual_seed(0)
    w_true = torch.randn(8, 1)
    x = torch.randn(640, 8)
    data = TensorDataset(x, x @ w_true + 0.01 * torch.randn(640, 1))
    loader = DataLoader(data, batch_size=16, shuffle=False)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rollback = bt.Rollback(model, opt, every=4, keep=2, lr_factor=0.5, skip_batches=3, max_retries=2)
    rules = [
        Spike("loss", ratio=5.0, window=10, patience=1, warmup=10, action="rollback"),
        NonFinite("loss", action="stop"),
    ]
    sink = ListSink()
    yielded: list[tuple[int, int]] = []
    corrupt_at = 25
    with bt.Tap(
        [bt.metrics.Loss(), bt.metrics.LearningRate(opt)], [sink], rules=rules, rollback=rollback, flush_every=2
    ) as tap:
        with tap.run():
            step = 0
            for epoch in range(3):
                for xb, yb in tap.watch(loader, epoch=epoch):
                    yielded.append((epoch, len([1 for e, _ in yielded if e == epoch])))
                    loss = F.mse_loss(model(xb), yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if step == corrupt_at:
                        with torch.no_grad():
                            model.weight.mul_(1e3)  # what a bad update looks like
                    tap.step(loss=loss)
                    step += 1
                    assert not tap.should_stop
    actions = [e.message for e in sink.events if e.kind is EventKind.ACTION]
    assert any("rollback" in m.lower() and "restored" in m.lower() for m in actions), actions
    skipped = [m for m in actions if "skipped batches" in m]
    assert len(skipped) == 1
    named = skipped[0].split("(epoch:batch) ")[1].split(", ")
    assert len(named) == 3
    losses = sink.values("loss")
    assert math.isfinite(losses[-1]) and losses[-1] < 1.0
    assert max(losses) > 100  # the spike happened and was recorded
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)  # scaled once by lr_factor
    total_batches = 3 * len(loader)
    assert step == total_batches - 3  # the three skipped batches never reached the loop


def test_batch_size_rule_grows_the_sampler_within_bounds() -> None:
    data = TensorDataset(torch.randn(2000, 4), torch.zeros(2000, dtype=torch.long))
    sampler = bt.AdaptiveBatchSampler(data, batch_size=8, min_size=4, max_size=64)
    loader = DataLoader(data, batch_sampler=sampler)
    rule = bt.BatchSizeRule(sampler, "accuracy", grow_above=0.9, shrink_below=0.1, factor=2, cooldown=3)
    sizes = []
    with bt.Tap([bt.metrics.Accuracy()], [ListSink()], rules=[rule], flush_every=1) as tap, tap.run():
        for xb, yb in tap.watch(loader):
            sizes.append(len(xb))
            out = torch.zeros(len(xb), 2)
            out[:, 0] = 1.0  # always right: accuracy 1.0
            tap.step(outputs=out, targets=yb)
    assert sizes[0] == 8 and max(sizes) == 64 and sum(sizes) == 2000
    assert all(b >= a for a, b in zip(sizes, sizes[1:-1]))  # only grows (the last batch may be short)
