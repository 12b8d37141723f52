"""A tiny GAN: generator G and discriminator D (MLPs), two Adam optimizers with different learning
rates and a scheduler on D's, one ``tap.step`` per iteration recording D's loss as ``loss`` and G's
as an extra, both learning rates and both gradient norms.

Where the gradient norms come from: ``GradNorm`` reads ``.grad`` when ``tap.step`` runs, so the loop
is written so both models' gradients are those of their own update at that moment: every
``zero_grad`` comes *before* its model's backward (as the PyTorch DCGAN example does), and D is
frozen (``D.requires_grad_(False)``, as pix2pix/CycleGAN's ``set_requires_grad``) during G's
backward, so G's loss adds nothing to D's gradients. ``tap.step`` then runs after both updates. The
test also checks that D's gradient at ``tap.step`` is still the one its own backward left.

Two variants: a WGAN critic loss (negative values are legal: ``Loss(nonnegative=False)``) with
explicit metrics, and the BCE loss with the default metrics built from mappings
(``bt.Tap(optimizer={"g": ..., "d": ...}, model={"g": ..., "d": ...})``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_all_finite, assert_clean, assert_one_record_per_step

STEPS = 10
BATCH = 32
Z = 4


def _norm(model: nn.Module) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))


@pytest.mark.parametrize("objective", ["wgan", "bce"], ids=["wgan-explicit-metrics", "bce-default-metrics"])
def test_gan_two_optimizers_every_value_equals_item(sink: ListSink, objective: str) -> None:
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(Z, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-2, betas=(0.5, 0.999))
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(5)
    center = torch.tensor([2.0, -1.0])

    if objective == "wgan":
        tap = bt.Tap(
            [
                bt.metrics.Loss(nonnegative=False),
                bt.metrics.LearningRate(opt_g, name="lr_g"),
                bt.metrics.LearningRate(opt_d, name="lr_d"),
                bt.metrics.GradNorm(G, name="grad_norm_g"),
                bt.metrics.GradNorm(D, name="grad_norm_d"),
                bt.metrics.StepTime(),
            ],
            [sink],
            flush_every=4,
        )
    else:
        tap = bt.Tap(optimizer={"g": opt_g, "d": opt_d}, model={"g": G, "d": D}, sinks=[sink], flush_every=4)

    expected = []
    with tap, tap.run(name=f"gan-{objective}"):
        for step in range(STEPS):
            real = center + 0.5 * torch.randn(BATCH, 2, generator=g)
            z = torch.randn(BATCH, Z, generator=g)
            # (1) D's update
            opt_d.zero_grad(set_to_none=True)
            fake = G(z)
            real_score, fake_score = D(real), D(fake.detach())
            if objective == "wgan":
                d_loss = fake_score.mean() - real_score.mean()
            else:
                d_loss = F.binary_cross_entropy_with_logits(
                    real_score, torch.ones_like(real_score)
                ) + F.binary_cross_entropy_with_logits(fake_score, torch.zeros_like(fake_score))
            d_loss.backward()
            norm_d_own = _norm(D)
            opt_d.step()
            # (2) G's update, D frozen so its gradients stay those of (1)
            opt_g.zero_grad(set_to_none=True)
            D.requires_grad_(False)
            score = D(fake)
            if objective == "wgan":
                g_loss = -score.mean()
            else:
                g_loss = F.binary_cross_entropy_with_logits(score, torch.ones_like(score))
            g_loss.backward()
            D.requires_grad_(True)
            opt_g.step()
            tap.step(loss=d_loss, extra={"g_loss": g_loss})
            norm_d = _norm(D)
            assert norm_d == norm_d_own  # D's gradient is still the one of its own update
            expected.append(
                {
                    "loss": d_loss.item(),
                    "g_loss": g_loss.item(),
                    "lr_g": opt_g.param_groups[0]["lr"],
                    "lr_d": opt_d.param_groups[0]["lr"],
                    "grad_norm_g": _norm(G),
                    "grad_norm_d": norm_d,
                }
            )
            sched_d.step()

    rows = assert_one_record_per_step(sink.records, STEPS)
    assert_clean(sink.events)
    assert_all_finite(rows)
    assert len({e["lr_d"] for e in expected}) == 4 and len({e["lr_g"] for e in expected}) == 1
    if objective == "wgan":
        assert any(e["loss"] < 0 for e in expected), [
            e["loss"] for e in expected
        ]  # negative losses occurred and are not anomalies
    for record, ref in zip(rows, expected):
        values = record.values
        assert values["loss"] == ref["loss"], record.step  # float32 loss tensors, copied
        assert values["g_loss"] == ref["g_loss"], record.step
        assert values["lr_g"] == ref["lr_g"] and values["lr_d"] == ref["lr_d"], record.step
        # batchtap's float32 foreach norms vs float64 norms of the same gradients
        assert values["grad_norm_g"] == pytest.approx(ref["grad_norm_g"], rel=F32_REL), record.step
        assert values["grad_norm_d"] == pytest.approx(ref["grad_norm_d"], rel=F32_REL), record.step
        assert "grad_norm" not in values and "lr" not in values and "accuracy" not in values
