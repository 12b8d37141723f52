"""LossScale on a real GradScaler (CPU): the scale, and the skipped steps, whether tap.step sits
before or after scaler.update()."""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from batchtap.metrics import StepInputs
from tests.metrics._helpers import CountOps, raw

INPUTS = StepInputs(None, None, None, 4.0)


class AmpLoop:
    """A small AMP loop: scale(loss).backward(), step, update; a step can be given inf gradients."""

    def __init__(self, seed: int, growth_interval: int = 1000) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(5, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=growth_interval)

    def backward(self, overflow: bool) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(torch.randn(4, 5)).pow(2).mean()
        self.scaler.scale(loss).backward()
        if overflow:
            self.model.weight.grad[0, 0] = math.inf

    def step(self) -> bool:
        """scaler.step; returns whether the optimizer step was skipped (the reference)."""
        before = self.model.weight.detach().clone()
        self.scaler.step(self.opt)
        return bool(torch.equal(before, self.model.weight.detach()))


OVERFLOWS = [False, True, False, False, True, True, False]


def _values(metric, raws):
    return metric.finalize(raws, None), metric.skipped(raws)


def test_skip_from_the_scalers_check_before_update() -> None:
    loop, metric = AmpLoop(0), None
    for overflow in OVERFLOWS:
        loop.backward(overflow)
        skipped = loop.step()
        assert skipped == overflow
        metric = metric or bt.metrics.LossScale(loop.scaler)
        scale = loop.scaler.get_scale()  # the scale this step's loss was multiplied by
        (got_scale, got_flag), got_skipped = _values(metric, raw(metric, INPUTS))
        assert (got_scale, got_flag, got_skipped) == (scale, float(overflow), overflow)
        loop.scaler.update()


def test_skip_after_unscale_before_step() -> None:
    loop = AmpLoop(1)
    metric = bt.metrics.LossScale(loop.scaler)
    for overflow in (True, False):
        loop.backward(overflow)
        loop.scaler.unscale_(loop.opt)
        assert metric.skipped(raw(metric, INPUTS)) is overflow
        loop.step()
        loop.scaler.update()


@pytest.mark.parametrize("growth_interval", [1, 1000], ids=["scale-grows", "scale-steady"])
def test_after_update_the_steps_own_scale_and_skip(growth_interval) -> None:
    """tap.step after scaler.update(): the scale this step's loss was multiplied by (copied in the
    optimizer's step pre-hook; a skipped step's is the lowered one divided back) and this step's
    skip, the first step's too."""
    loop = AmpLoop(2, growth_interval=growth_interval)
    metric = bt.metrics.LossScale(loop.scaler)
    for overflow in OVERFLOWS:
        loop.backward(overflow)
        scale = loop.scaler.get_scale()  # the scale this step's loss was multiplied by
        skipped = loop.step()
        loop.scaler.update()
        (got_scale, got_flag), got_skipped = _values(metric, raw(metric, INPUTS))
        assert got_scale == scale
        assert (got_flag, got_skipped) == (float(skipped), skipped)


def test_placed_before_scaler_step_the_skip_is_left_out_with_a_warning() -> None:
    loop = AmpLoop(3)
    metric = bt.metrics.LossScale(loop.scaler)
    for overflow in OVERFLOWS:
        loop.backward(overflow)
        scale = loop.scaler.get_scale()
        raws = raw(metric, INPUTS)
        assert _values(metric, raws) == ([scale, None], False)  # never a guess, never a step late
        assert "before scaler.step(optimizer)" in metric.warning(raws)
        loop.step()
        loop.scaler.update()


def test_disabled_or_unused_scaler_gives_no_values() -> None:
    for scaler in (torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu")):
        metric = bt.metrics.LossScale(scaler)
        raws = raw(metric, INPUTS)
        assert _values(metric, raws) == ([None, None], False)


def test_no_host_reads_and_few_ops() -> None:
    loop = AmpLoop(4)
    metric = bt.metrics.LossScale(loop.scaler)
    loop.backward(False)
    loop.step()
    with torch.no_grad(), CountOps() as counted:
        metric.compute(INPUTS)  # before update(): the scaler's own found_inf, as it is
    assert counted.ops == [], counted.ops
    loop.scaler.update()
    metric = bt.metrics.LossScale(loop.scaler)  # a loop calling tap.step after update()
    loop.backward(False)
    loop.step()
    loop.scaler.update()
    metric.compute(INPUTS)
    loop.backward(False)
    loop.step()
    loop.scaler.update()
    with torch.no_grad(), CountOps() as counted:
        metric.compute(INPUTS)  # after update(): the step's scale (copied in its hook) compared with now
    assert counted.host_reads == [] and len(counted.ops) <= 1, counted.ops


def test_declarations() -> None:
    metric = bt.metrics.LossScale(torch.amp.GradScaler("cpu"))
    loss_scale, skipped = metric.outputs()
    assert (loss_scale.name, loss_scale.reduce, loss_scale.domain) == (
        "loss_scale",
        bt.metrics.Reduce.MAX,
        bt.metrics.NONNEGATIVE,
    )
    assert (skipped.name, skipped.reduce) == ("amp_skipped", bt.metrics.Reduce.MAX)
    assert (skipped.domain.low, skipped.domain.high) == (0.0, 1.0)
    assert not metric.per_micro_batch
    with pytest.raises(bt.ConfigError, match="LossScale needs a torch.amp.GradScaler, got SGD"):
        bt.metrics.LossScale(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))  # type: ignore[arg-type]


@pytest.mark.parametrize("placement", ["before-update", "after-update"])
def test_one_scaler_over_two_optimizers_keeps_a_skip_of_either(sink, placement: str) -> None:
    """One GradScaler steps two optimizers; at step 2 only the second one's gradients are inf (the
    scaler skips that optimizer): the row's ``amp_skipped`` is 1 wherever ``tap.step`` sits."""
    torch.manual_seed(3)
    a, b = torch.nn.Linear(5, 2), torch.nn.Linear(5, 2)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    used = []
    tap = bt.Tap([bt.metrics.Loss(nonnegative=False), bt.metrics.LossScale(scaler)], [sink], flush_every=4)
    with tap, tap.run(name="one-scaler"):
        for step in range(5):
            x = torch.randn(4, 5)
            loss = a(x).pow(2).mean() + b(x).pow(2).mean()
            used.append(scaler.get_scale())
            scaler.scale(loss).backward()
            if step == 2:
                b.weight.grad[0, 0] = math.inf
            scaler.step(opt_a)
            scaler.step(opt_b)
            if placement == "before-update":
                tap.step(loss=loss)
            scaler.update()
            if placement == "after-update":
                tap.step(loss=loss)
            opt_a.zero_grad()
            opt_b.zero_grad()
    rows = [r for r in sink.records if not r.sparse]
    assert [r.values["amp_skipped"] for r in rows] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert [r.values["loss_scale"] for r in rows] == used
