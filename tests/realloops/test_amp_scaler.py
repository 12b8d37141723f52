"""An AMP loop with ``torch.amp.GradScaler`` (on the CPU: ``GradScaler("cpu")`` with fp16 autocast),
the way the PyTorch AMP recipe writes it, with overflows forced on chosen steps (an inf planted in a
gradient after ``backward()``, as a real fp16 overflow leaves it).

Two placements of the gradient norm, each as users write them:

* ``clip``: ``scaler.unscale_(opt); norm = clip_grad_norm_(...)``, ``tap.step(grad_norm=norm)``;
* ``no-clip``: no clipping, ``bt.Tap(model=model, scaler=scaler)`` computes the norm itself
  (``GradNorm(model, scaler=scaler)``) after ``scaler.step(opt)``, where the gradients are unscaled;
  the same with the metrics listed explicitly (``GradNorm(model, scaler=)``, ``LossScale(scaler)``).

``tap.step`` sits after ``scaler.step(opt)`` and before ``scaler.update()`` (the recommended place:
``loss_scale`` is the scale this step's loss was multiplied by, the skip is the scaler's own check);
``clip-after-update`` puts it at the end of the iteration, after ``scaler.update()``, where many loops
have it: ``loss_scale`` is still this step's scale (copied in the optimizer's step pre-hook) and the
skip this step's (the scale's drop).
Every stored value is compared with what ``.item()`` says in the same loop.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink
from tests.realloops._loops import (
    F32_REL,
    assert_one_record_per_step,
    events_of,
)

STEPS = 14
OVERFLOW_AT = (3, 4, 9)  # two in a row, then one after the scale grew back
INIT_SCALE = 2.0**12
GROWTH_INTERVAL = 3


def _grad_norm_by_hand(model: nn.Module) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters() if p.grad is not None))


@pytest.mark.parametrize(
    ("clip", "after_update", "explicit"),
    [(True, False, False), (False, False, False), (False, False, True), (True, True, False)],
    ids=["clip-grad_norm=", "no-clip-Tap(model,scaler)", "no-clip-explicit-GradNorm-LossScale", "clip-after-update"],
)
def test_amp_grad_scaler_with_forced_overflows(sink: ListSink, clip: bool, after_update: bool, explicit: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 6))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    g = torch.Generator().manual_seed(11)
    data = [(torch.randn(16, 12, generator=g), torch.randint(0, 6, (16,), generator=g)) for _ in range(STEPS)]

    rules = [bt.rules.NonFinite("grad_norm")]
    if explicit:
        metrics = [
            bt.metrics.Loss(),
            bt.metrics.Accuracy(),
            bt.metrics.LearningRate(opt),
            bt.metrics.GradNorm(model, scaler=scaler),
            bt.metrics.LossScale(scaler),
        ]
        tap = bt.Tap(metrics, [sink], flush_every=4, rules=rules)
    else:
        tap = bt.Tap(
            optimizer=opt, model=None if clip else model, scaler=scaler, sinks=[sink], flush_every=4, rules=rules
        )
    expected: list[dict[str, float]] = []
    scales_seen: list[float] = []
    with tap, tap.run(name="amp"):
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                loss = F.cross_entropy(out, y)
            assert out.dtype == torch.float16
            scaler.scale(loss).backward()
            if step in OVERFLOW_AT:
                model[0].weight.grad[0, 0] = math.inf  # what an fp16 overflow leaves in a gradient
            scale = scaler.get_scale()  # the scale this step's loss was multiplied by (.item())
            if clip:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                ref_norm = norm.item()
                scaler.step(opt)
                if not after_update:
                    tap.step(loss=loss, outputs=out, targets=y, grad_norm=norm)
            else:
                scaler.step(opt)  # unscales the gradients in place, then steps unless they hold inf/NaN
                ref_norm = _grad_norm_by_hand(model)
                tap.step(loss=loss, outputs=out, targets=y)
            scaler.update()
            skipped = scaler.get_scale() < scale  # the scaler halves its scale on a skip
            if after_update:
                tap.step(loss=loss, outputs=out, targets=y, grad_norm=norm)
            expected.append(
                {
                    "loss": loss.item(),
                    "accuracy": (out.float().argmax(1) == y).float().mean().item(),
                    "lr": opt.param_groups[0]["lr"],
                    "loss_scale": scale,  # the step's own wherever tap.step sits
                    "amp_skipped": float(skipped),
                    "grad_norm": ref_norm,
                }
            )
            scales_seen.append(scale)
            assert not tap.should_stop, tap.stop_reason

    # the scripted overflows were the scaler's skips, and the scale moved both ways
    assert [s for s, e in enumerate(expected) if e["amp_skipped"]] == list(OVERFLOW_AT)
    assert min(scales_seen) < INIT_SCALE < max(scales_seen)

    rows = assert_one_record_per_step(sink.records, STEPS)
    assert not events_of(sink.events, bt.EventKind.ANOMALY), [e.message for e in sink.events]
    assert not events_of(sink.events, bt.EventKind.ACTION), [e.message for e in sink.events]  # NonFinite did not fire
    assert not events_of(sink.events, bt.EventKind.WARNING), [e.message for e in sink.events]
    skips = events_of(sink.events, bt.EventKind.SKIP)
    assert [e.step for e in skips] == list(OVERFLOW_AT)  # one per skipped step, at that step
    assert [r.status for r in sink.ended] == [bt.RunStatus.FINISHED] and tap.stop_reason is None

    for record, ref in zip(rows, expected):
        values = record.values
        assert values["loss"] == ref["loss"], record.step  # the float32 loss tensor, copied
        assert values["accuracy"] == pytest.approx(ref["accuracy"], rel=1e-12, abs=0), record.step
        assert values["lr"] == ref["lr"]
        assert values["loss_scale"] == ref["loss_scale"], record.step  # a power of two, float32 exact
        assert values["amp_skipped"] == ref["amp_skipped"], record.step
        if ref["amp_skipped"]:
            assert not math.isfinite(ref["grad_norm"])
            assert "grad_norm" not in values, record.step  # left out, not stored as an anomaly
        elif clip:
            assert values["grad_norm"] == ref["grad_norm"], record.step  # clip_grad_norm_'s tensor, copied
        else:
            # batchtap's float32 foreach norm vs a float64 norm of the same (unscaled) gradients
            assert values["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), record.step
