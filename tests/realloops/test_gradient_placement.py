"""The explicit API's gradient norm, loss scale and AMP skip wherever the loop calls what (issue 26).

``GradNorm`` takes the norm on the device in the optimizer's step pre-hook and ``LossScale`` copies
the scale there, so ``tap.step`` may sit before or after ``optimizer.step()`` / ``scaler.step()``,
before or after ``scaler.update()``, ``zero_grad(set_to_none=True)`` may come right after the step,
and the scheduler before or after ``tap.step``: every stored value is the step's own, compared
with the loop's ``.item()`` reference. The one order where a value cannot be known (``tap.step``
before ``scaler.step``: the scaler has not checked for inf/NaN yet) leaves ``amp_skipped`` out with
one warning. Host reads added by the hooks: none (counted over the same iterations with the Tap on
and off).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from tests.conftest import ListSink
from tests.realloops._loops import F32_REL, assert_one_record_per_step, events_of

STEPS = 14
OVERFLOW_AT = (3, 4, 9)  # two in a row, then one after the scale grew back
INIT_SCALE = 2.0**12


def _norm(model: nn.Module, divide: float = 1.0) -> float:
    total = sum(p.grad.double().pow(2).sum().item() for p in model.parameters() if p.grad is not None)
    return math.sqrt(total) / divide


def run_loop(
    sink: ListSink | None,
    *,
    tap_at: str,
    zero: str,
    scaler_kind: str | None,
    clip: bool,
    explicit: bool = False,
    overflow_at: tuple[int, ...] = OVERFLOW_AT,
) -> tuple[list[dict[str, float]], list[int]]:
    """One training loop; ``tap_at``: ``before-step`` / ``after-step`` (after ``optimizer.step()`` or
    ``scaler.step()``, before ``update()`` and the scheduler) / ``end`` (after the scheduler,
    ``update()`` and, with ``zero="end"``, ``zero_grad``). Returns the references and the host
    reads per iteration of the loop's own calls (step, update, scheduler, zero_grad, tap.step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 6))
    if scaler_kind == "fused":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3) if scaler_kind else None
    g = torch.Generator().manual_seed(11)
    data = [(torch.randn(16, 12, generator=g), torch.randint(0, 6, (16,), generator=g)) for _ in range(STEPS)]
    tap: bt.Tap | None = None
    if sink is not None:
        if explicit:
            metrics: list[Any] = [
                bt.metrics.Loss(),
                bt.metrics.LearningRate(opt, scaler=scaler),
                bt.metrics.GradNorm(model, scaler=scaler),
            ]
            if scaler is not None:
                metrics.append(bt.metrics.LossScale(scaler))
            tap = bt.Tap(metrics, [sink], flush_every=4)
        else:
            tap = bt.Tap(optimizer=opt, model=None if clip else model, scaler=scaler, sinks=[sink], flush_every=4)
        tap.start(name=f"{tap_at}-{zero}-{scaler_kind}-{clip}")
    expected: list[dict[str, float]] = []
    reads: list[int] = []
    for step, (x, y) in enumerate(data):
        if zero == "before-backward":
            opt.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=torch.float16) if scaler is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            out = model(x)
            loss = F.cross_entropy(out, y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None and step in overflow_at:
            model[0].weight.grad[0, 0] = math.inf  # what an fp16 overflow leaves in a gradient
        scale = scaler.get_scale() if scaler is not None else math.nan
        norm: torch.Tensor | None = None
        if clip:
            if scaler is not None:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            ref_norm = norm.item()
        else:  # the step's unscaled gradients, as the optimizer gets them
            ref_norm = _norm(model, scale if scaler is not None else 1.0)
        lr = opt.param_groups[0]["lr"]

        def tap_step() -> None:
            if tap is not None:
                tap.step(loss=loss, outputs=out, targets=y, grad_norm=norm)

        order = ["step", "tap"] if tap_at == "after-step" else ["tap", "step"] if tap_at == "before-step" else ["step"]
        order += ["update"] if scaler is not None else []
        order += ["sched"] + (["zero"] if zero == "end" else []) + (["tap"] if tap_at == "end" else [])
        with HostReadCounter() as counter:
            for action in order:
                if action == "step":
                    if scaler is not None:
                        scaler.step(opt)
                    else:
                        opt.step()
                elif action == "update":
                    assert scaler is not None
                    scaler.update()
                elif action == "sched":
                    sched.step()
                elif action == "zero":
                    opt.zero_grad(set_to_none=True)
                else:
                    tap_step()
        reads.append(counter.count)
        skipped = scaler is not None and scaler.get_scale() < scale
        expected.append(
            {"loss": loss.item(), "lr": lr, "grad_norm": ref_norm, "loss_scale": scale, "amp_skipped": float(skipped)}
        )
    if tap is not None:
        tap.finish()
        tap.close()
    if scaler is not None:
        assert [s for s, e in enumerate(expected) if e["amp_skipped"]] == list(overflow_at)
    return expected, reads


CASES = [
    # no scaler: the norm is the step's whatever zero_grad and tap.step do
    ("after-step", "before-backward", None, False),
    ("after-step", "end", None, False),
    ("end", "end", None, False),  # optimizer.step(); scheduler.step(); zero_grad(); tap.step()
    ("before-step", "end", None, False),
    ("end", "end", None, True),  # clip_grad_norm_ passed as grad_norm=
    ("before-step", "before-backward", None, True),
    # GradScaler: after scaler.step, after update(), before scaler.step
    ("after-step", "before-backward", "sgd", False),
    ("after-step", "end", "sgd", False),
    ("end", "end", "sgd", False),
    ("end", "before-backward", "sgd", False),
    ("end", "end", "sgd", True),
    ("end", "end", "fused", False),
    ("after-step", "end", "fused", False),
    ("end", "end", "fused", True),
    ("before-step", "before-backward", "sgd", False),
    ("before-step", "end", "sgd", True),
]


@pytest.mark.parametrize(("tap_at", "zero", "scaler_kind", "clip"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_every_value_is_the_steps_own(
    sink: ListSink, tap_at: str, zero: str, scaler_kind: str | None, clip: bool
) -> None:
    _, reads_off = run_loop(None, tap_at=tap_at, zero=zero, scaler_kind=scaler_kind, clip=clip)
    expected, reads_on = run_loop(sink, tap_at=tap_at, zero=zero, scaler_kind=scaler_kind, clip=clip)
    # tap.step reads nothing (tests/test_no_sync.py); the step hooks add nothing either
    assert reads_on[1:] == reads_off[1:]
    rows = assert_one_record_per_step(sink.records, STEPS)
    warnings = [e.message for e in events_of(sink.events, bt.EventKind.WARNING)]
    anomalies = events_of(sink.events, bt.EventKind.ANOMALY)
    # before scaler.step the skip is known only where the loop unscaled first (clipping: unscale_)
    skip_known = scaler_kind is not None and (tap_at != "before-step" or clip)
    if skip_known:
        assert [e.step for e in events_of(sink.events, bt.EventKind.SKIP)] == list(OVERFLOW_AT)
    if scaler_kind is not None and not skip_known:
        # the one order that cannot know the skip: said once, the value left out, never a guess
        assert len(warnings) == 1 and "amp_skipped" in warnings[0], warnings
        assert sorted({e.step for e in anomalies}) == list(OVERFLOW_AT)  # the inf norm is not hidden
    else:
        assert not warnings and not anomalies, (warnings, [e.message for e in anomalies])
    for record, ref in zip(rows, expected):
        values = record.values
        at = record.step
        assert values["loss"] == ref["loss"], at
        assert values["lr"] == ref["lr"], at  # the lr the step used, not the next one's
        if scaler_kind is not None:
            assert values["loss_scale"] == ref["loss_scale"], at  # the step's scale, not update()'s
            if skip_known:
                assert values["amp_skipped"] == ref["amp_skipped"], at
            else:
                assert "amp_skipped" not in values, at
        if ref["amp_skipped"] or not math.isfinite(ref["grad_norm"]):
            assert "grad_norm" not in values or not math.isfinite(values["grad_norm"]), at
        elif clip:
            assert values["grad_norm"] == ref["grad_norm"], at  # clip_grad_norm_'s tensor, copied
        else:
            assert values["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), at


@pytest.mark.parametrize("scaler_kind", [None, "sgd"])
def test_explicit_metrics_after_zero_grad_and_update(sink: ListSink, scaler_kind: str | None) -> None:
    """``bt.metrics.GradNorm(model, scaler=)`` / ``LossScale(scaler)`` listed by hand, ``tap.step`` last."""
    expected, _ = run_loop(sink, tap_at="end", zero="end", scaler_kind=scaler_kind, clip=False, explicit=True)
    rows = assert_one_record_per_step(sink.records, STEPS)
    assert not events_of(sink.events, bt.EventKind.WARNING)
    for record, ref in zip(rows, expected):
        if ref["amp_skipped"]:
            assert "grad_norm" not in record.values
        else:
            assert record.values["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), record.step
        if scaler_kind is not None:
            assert record.values["loss_scale"] == ref["loss_scale"], record.step


class _SubclassedSGD(torch.optim.SGD):
    """An optimizer whose step calls ``super().step()`` (hooks fire nested) and raises when told."""

    fail_next = False

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("planted")
        return super().step(closure)


def test_nested_and_raising_optimizer_steps(sink: ListSink) -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    torch.optim.SGD(model.parameters(), lr=0.1)  # SGD.step gets its own hook wrapper too: nested hooks
    opt = _SubclassedSGD(model.parameters(), lr=0.1)
    tap = bt.Tap(optimizer=opt, model=model, sinks=[sink], flush_every=3)
    refs = []
    with tap, tap.run(name="nested"):
        for step in range(8):
            x, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            ref = _norm(model)
            if step == 2:
                opt.fail_next = True
                with pytest.raises(RuntimeError, match="planted"):
                    opt.step()  # its post-hooks never fire
            opt.step()
            opt.zero_grad(set_to_none=True)
            tap.step(loss=loss, outputs=out, targets=y)
            refs.append(ref)
    rows = assert_one_record_per_step(sink.records, 8)
    assert not events_of(sink.events, bt.EventKind.WARNING)
    for record, ref in zip(rows, refs):
        assert record.values["grad_norm"] == pytest.approx(ref, rel=F32_REL), record.step


def test_closure_step_takes_the_norm_after_the_closure(sink: ListSink) -> None:
    """A step given a closure (LBFGS, Lightning's automatic optimization) computes the gradients
    inside the step: the norm is taken in the post-hook, of the closure's gradients."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tap = bt.Tap(optimizer=opt, model=model, sinks=[sink], flush_every=3)
    refs = []
    with tap, tap.run(name="closure"):
        for _ in range(5):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            seen: list[torch.Tensor] = []

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                seen.append(loss.detach())
                refs.append(_norm(model))
                return loss

            opt.step(closure)
            opt.zero_grad(set_to_none=True)
            tap.step(loss=seen[-1])
    rows = assert_one_record_per_step(sink.records, 5)
    for record, ref in zip(rows, refs):
        assert record.values["grad_norm"] == pytest.approx(ref, rel=F32_REL), record.step


@pytest.mark.parametrize(("tap_at", "zero"), [("end", "end"), ("after-step", "end"), ("end", "before-backward")])
def test_first_step_skipped_by_the_scaler(sink: ListSink, tap_at: str, zero: str) -> None:
    """The run's first step skipped (common with fp16's initial scale): no optimizer hook fires, and
    the scaler's state tells that ``tap.step`` comes after the step, not before it."""
    overflows = (0, 1, 6)
    expected, _ = run_loop(sink, tap_at=tap_at, zero=zero, scaler_kind="sgd", clip=False, overflow_at=overflows)
    rows = assert_one_record_per_step(sink.records, STEPS)
    assert [e.step for e in events_of(sink.events, bt.EventKind.SKIP)] == list(overflows)
    warnings = [e.message for e in events_of(sink.events, bt.EventKind.WARNING)]
    for record, ref in zip(rows, expected):
        values = record.values
        assert values["loss_scale"] == ref["loss_scale"], record.step
        assert values["amp_skipped"] == ref["amp_skipped"], record.step
        if "lr" in values or record.step not in (0, 1):  # skipped before any step ran: see below
            assert values["lr"] == ref["lr"], record.step
        if not ref["amp_skipped"]:
            assert values["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), record.step
    # before any step ran, a skipped step's lr cannot be told when the scheduler moved it before
    # tap.step (where it moves is not known yet): left out, said once, never the next step's
    if any("lr" not in r.values for r in rows):
        assert len(warnings) == 1 and "lr" in warnings[0], warnings
    else:
        assert not warnings, warnings
