"""The real-loop suite's loops, unmodified (no batchtap line inside), under ``bt.autolog()``: every
stored value against the loop's own ``.item()`` value, and no host read added per iteration
(counted with autolog on and off, over the same iterations)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from tests.autolog._helpers import Reads, autologged
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step, events_of
from tests.realloops.test_nanogpt_char_lm import GPT, Config, configure_optimizers, get_lr, make_get_batch

# ---------------------------------------------------------------------- char LM (nanoGPT)


def char_lm_loop(reads: Reads) -> list[dict[str, float]]:
    """nanoGPT's loop: hand-set lr, 4 uneven micro-batches with (loss / accum).backward(), bf16
    autocast, -100 padding, clip_grad_norm_, zero_grad(set_to_none=True) after the step, eval."""
    cfg = Config()
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = configure_optimizers(model, cfg)
    get_batch = make_get_batch(cfg)
    V = cfg.vocab_size

    @torch.no_grad()
    def estimate_loss() -> torch.Tensor:
        model.eval()
        x, y = get_batch("val", 4)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).view(-1, V), y.view(-1), ignore_index=-100)
        model.train()
        return loss

    expected = []
    for it in range(cfg.max_iters):
        micro = []
        with reads.iteration(it):
            lr = get_lr(it, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for m in range(cfg.accum):
                x, y = get_batch("train", cfg.micro_batch_sizes[m])
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x)
                    loss = F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100)
                (loss / cfg.accum).backward()
                micro.append((loss, logits, y))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if it % cfg.eval_interval == 0:
                estimate_loss()
        weighted = sum(loss.item() * y.size(0) for loss, _, y in micro)
        samples = sum(y.size(0) for _, _, y in micro)
        keep = [y != -100 for _, _, y in micro]
        correct = sum(((lg.float().argmax(-1) == y) & k).sum().item() for (_, lg, y), k in zip(micro, keep))
        kept = sum(k.sum().item() for k in keep)
        expected.append({"loss": weighted / samples, "accuracy": correct / kept, "lr": lr, "grad_norm": norm.item()})
    return expected


def test_char_lm_unmodified(sink: ListSink) -> None:
    off = Reads()
    char_lm_loop(off)
    on = Reads()
    with autologged(sink, name="char-lm"):
        expected = char_lm_loop(on)
    assert on.counts == off.counts  # nothing added, iteration by iteration
    rows = assert_one_record_per_step(sink.records, len(expected))
    assert [r.status for r in sink.ended] == [bt.RunStatus.FINISHED]
    notes = [e.message for e in events_of(sink.events, bt.EventKind.INFO)]
    assert len([m for m in notes if "gradient-accumulation" in m]) == 1, notes  # said once, what was assumed
    assert not events_of(sink.events, bt.EventKind.WARNING)  # a note, not a warning
    assert not events_of(sink.events, bt.EventKind.ANOMALY)
    for record, ref in zip(rows, expected):
        values = record.values
        assert values["loss"] == pytest.approx(ref["loss"], rel=F32_REL), record.step
        assert values["accuracy"] == pytest.approx(ref["accuracy"], rel=1e-12, abs=0), record.step
        assert values["lr"] == ref["lr"], record.step  # the lr set by hand before the step, not the next one
        assert values["grad_norm"] == ref["grad_norm"], record.step  # clip_grad_norm_'s pre-clip norm
        assert "lr_group1" not in values
        if record.step >= 1:
            assert values["step_time"] > 0 and values["throughput"] > 0


# ---------------------------------------------------------------------- AMP GradScaler with forced overflows

STEPS = 14
OVERFLOW_AT = (3, 4, 9)


def _norm(model: nn.Module) -> float:
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters() if p.grad is not None))


def amp_loop(reads: Reads, *, clip: bool, fused: bool) -> list[dict[str, float]]:
    """The AMP recipe on the CPU (fp16 autocast, GradScaler("cpu")), overflows planted after
    backward(), OneCycleLR stepped after the optimizer, every iteration."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 6))
    if fused:
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    g = torch.Generator().manual_seed(11)
    data = [(torch.randn(16, 12, generator=g), torch.randint(0, 6, (16,), generator=g)) for _ in range(STEPS)]
    expected = []
    for step, (x, y) in enumerate(data):
        with reads.iteration(step):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                loss = F.cross_entropy(out, y)
            scaler.scale(loss).backward()
            if step in OVERFLOW_AT:
                model[0].weight.grad[0, 0] = math.inf  # what an fp16 overflow leaves in a gradient
        scale = scaler.get_scale()  # the reference, outside the counted part
        lr = opt.param_groups[0]["lr"]
        scaled_norm = _norm(model) / scale
        with reads.iteration(step):
            if clip:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
        skipped = scaler.get_scale() < scale
        expected.append(
            {
                "loss": loss.item(),
                "accuracy": (out.float().argmax(1) == y).float().mean().item(),
                "lr": lr,
                "loss_scale": scale,
                "amp_skipped": float(skipped),
                "grad_norm": norm.item() if clip else scaled_norm,
            }
        )
    return expected


@pytest.mark.parametrize(
    ("clip", "fused"),
    [(True, False), (False, False), (False, True)],
    ids=["sgd-unscale-clip", "sgd-no-clip", "fused-adam-no-clip"],
)
def test_amp_grad_scaler_unmodified(sink: ListSink, clip: bool, fused: bool) -> None:
    off = Reads()
    amp_loop(off, clip=clip, fused=fused)
    on = Reads()
    with autologged(sink, name="amp", rules=[bt.rules.NonFinite("grad_norm")]):
        expected = amp_loop(on, clip=clip, fused=fused)
    assert on.counts == off.counts
    assert [s for s, e in enumerate(expected) if e["amp_skipped"]] == list(OVERFLOW_AT)
    rows = assert_one_record_per_step(sink.records, STEPS)
    assert [e.step for e in events_of(sink.events, bt.EventKind.SKIP)] == list(OVERFLOW_AT)
    assert not events_of(sink.events, bt.EventKind.ANOMALY), [e.message for e in sink.events]
    assert not events_of(sink.events, bt.EventKind.ACTION)  # NonFinite("grad_norm") did not fire on skips
    assert [r.status for r in sink.ended] == [bt.RunStatus.FINISHED]
    for record, ref in zip(rows, expected):
        values = record.values
        assert values["loss"] == ref["loss"], record.step  # the unscaled fp32 loss tensor itself
        assert values["accuracy"] == pytest.approx(ref["accuracy"], rel=1e-12, abs=0), record.step
        assert values["lr"] == ref["lr"], record.step  # the lr the step used, OneCycleLR stepped after it
        assert values["loss_scale"] == ref["loss_scale"], record.step  # this step's scale, not the next one's
        assert values["amp_skipped"] == ref["amp_skipped"], record.step
        if ref["amp_skipped"]:
            assert "grad_norm" not in values, record.step
        elif clip:
            assert values["grad_norm"] == ref["grad_norm"], record.step
        else:
            assert values["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), record.step


# ---------------------------------------------------------------------- GAN with two optimizers


def gan_loop(reads: Reads, objective: str) -> list[dict[str, float]]:
    """The realloops GAN: opt_g made first, D's update then G's (D frozen), StepLR on D's lr."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-2, betas=(0.5, 0.999))
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(5)
    center = torch.tensor([2.0, -1.0])
    expected = []
    for step in range(10):
        with reads.iteration(step):
            real = center + 0.5 * torch.randn(32, 2, generator=g)
            z = torch.randn(32, 4, generator=g)
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
        norm_d = _norm(D)
        with reads.iteration(step):
            opt_d.step()
            opt_g.zero_grad(set_to_none=True)
            D.requires_grad_(False)
            score = D(fake)
            g_loss = (
                -score.mean()
                if objective == "wgan"
                else F.binary_cross_entropy_with_logits(score, torch.ones_like(score))
            )
            g_loss.backward()
            D.requires_grad_(True)
            opt_g.step()
        expected.append(
            {
                "loss": g_loss.item(),
                "loss_1": d_loss.item(),
                "lr": opt_g.param_groups[0]["lr"],
                "lr_1": opt_d.param_groups[0]["lr"],
                "grad_norm": _norm(G),
                "grad_norm_1": norm_d,
            }
        )
        with reads.iteration(step):
            sched_d.step()
    return expected


@pytest.mark.parametrize("objective", ["wgan", "bce"])
def test_gan_two_optimizers_unmodified(sink: ListSink, objective: str) -> None:
    off = Reads()
    gan_loop(off, objective)
    on = Reads()
    with autologged(sink, name="gan"):
        expected = gan_loop(on, objective)
    assert on.counts == off.counts
    rows = assert_one_record_per_step(sink.records, len(expected))
    assert not events_of(sink.events, bt.EventKind.ANOMALY)  # negative WGAN losses are no anomaly
    assert len({e["lr_1"] for e in expected}) == 4
    for record, ref in zip(rows, expected):
        values = record.values
        for name in ("loss", "loss_1", "lr", "lr_1"):
            assert values[name] == ref[name], (record.step, name)
        for name in ("grad_norm", "grad_norm_1"):
            assert values[name] == pytest.approx(ref[name], rel=F32_REL), (record.step, name)
        assert "accuracy" not in values


# ---------------------------------------------------------------------- regression over a DataLoader


def regression_loop(reads: Reads) -> list[dict[str, float]]:
    """The tutorials' loop: a DataLoader, zero_grad first, MSE, StepLR stepped after every step,
    an evaluation pass under no_grad after each epoch."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 2, generator=g)
    x = torch.randn(120, 6, generator=g)
    data = TensorDataset(x, x @ w + 0.1 * torch.randn(120, 2, generator=g))
    train = DataLoader(data, batch_size=24, shuffle=True, generator=torch.Generator().manual_seed(1))
    val = DataLoader(data, batch_size=60)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    expected = []
    it = 0
    for _epoch in range(2):
        model.train()
        for xb, yb in train:
            with reads.iteration(it):
                opt.zero_grad()
                loss = F.mse_loss(model(xb), yb)
                loss.backward()
                opt.step()
            expected.append({"loss": loss.item(), "lr": opt.param_groups[0]["lr"], "grad_norm": _norm(model)})
            with reads.iteration(it):
                sched.step()
            it += 1
        model.eval()
        with torch.no_grad():
            for xb, yb in val:
                F.mse_loss(model(xb), yb)
    return expected


def test_regression_unmodified(sink: ListSink) -> None:
    off = Reads()
    regression_loop(off)
    on = Reads()
    with autologged(sink, name="regression"):
        expected = regression_loop(on)
    assert on.counts == off.counts
    rows = assert_one_record_per_step(sink.records, len(expected))
    assert len({e["lr"] for e in expected}) == 3
    notes = [e.message for e in events_of(sink.events, bt.EventKind.INFO)]
    assert len(notes) == 1 and "loss only, no accuracy" in notes[0], notes
    assert not events_of(sink.events, bt.EventKind.WARNING)
    assert not events_of(sink.events, bt.EventKind.ANOMALY)
    for record, ref in zip(rows, expected):
        values = record.values
        assert values["loss"] == ref["loss"], record.step
        assert values["lr"] == ref["lr"], record.step  # not the next step's, though StepLR ran before the row closed
        assert values["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), record.step
        assert values["data_time"] >= 0 and "accuracy" not in values
    assert [(r.epoch, r.batch) for r in rows] == [(e, b) for e in range(2) for b in range(5)]
