"""Rollback: bit-exact restore of model, optimizer and scheduler; snapshots, retries, disk mode."""

from __future__ import annotations

import math

import pytest
import torch

from batchtap.errors import ConfigError, TrainingDiverged
from batchtap.recovery import Rollback
from batchtap.recovery.rollback import _clone
from batchtap.rules import Action, Decision


def _decision(step: int) -> Decision:
    return Decision(
        step=step, rule="spike(loss)", metric="loss", actions=(Action.ROLLBACK,), message="loss 9 > 3 x EMA 1"
    )


def _setup(seed: int, optim: str = "adam", scheduler: str | None = "step"):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if optim == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    elif optim == "adamw-amsgrad":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = None
    if scheduler == "step":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    elif scheduler == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))
    gen = torch.Generator().manual_seed(seed + 1)
    return model, opt, sched, gen


def _train_step(model, opt, sched, gen) -> None:
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 2, (16,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if sched is not None:
        sched.step()


def _assert_tree_equal(a, b, *, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"tensor differs at {path}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_tree_equal(a[k], b[k], path=f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tree_equal(x, y, path=f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _scaled_lrs(opt_state: dict, scale: float) -> dict:
    out = _clone(opt_state)
    for g in out["param_groups"]:
        for key in ("lr", "initial_lr"):
            if key in g:
                g[key] *= scale
    return out


@pytest.mark.parametrize("where", ["memory", "disk"])
@pytest.mark.parametrize(
    ("optim", "scheduler"),
    [
        pytest.param("adam", "step", id="adam-steplr"),
        pytest.param("sgd", None, id="sgd-momentum"),
        pytest.param("adamw-amsgrad", "lambda", id="adamw-amsgrad-lambdalr"),
    ],
)
def test_restore_is_bit_exact(tmp_path, where, optim, scheduler):
    model, opt, sched, gen = _setup(11, optim, scheduler)
    rb = Rollback(model, opt, sched, every=3, keep=2, lr_factor=0.5, where="memory" if where == "memory" else tmp_path)
    for step in range(4):  # steps 0..3; snapshots at 0 and 3
        _train_step(model, opt, sched, gen)
        rb.maybe_snapshot(step)
    want_model, want_opt = _clone(model.state_dict()), _clone(opt.state_dict())
    want_sched = _clone(sched.state_dict()) if sched is not None else None
    for step in range(4, 9):  # diverge: train on (snapshot at 6), then poison every state tensor
        _train_step(model, opt, sched, gen)
        rb.maybe_snapshot(step)
        if step == 4:
            rb.confirm(4)  # the record of step 4 (first loss after step 3's update) was cleared
    with torch.no_grad():
        for t in [*model.state_dict().values()]:
            if t.is_floating_point():
                t.fill_(float("nan"))

    result = rb.restore(_decision(6), step=8)  # the rules flagged step 6; training is at step 8

    assert result is not None and result.restored_step == 3 and result.retry == 1
    assert result.undone_steps == range(4, 9) and result.lr_scale == 0.5
    _assert_tree_equal(model.state_dict(), want_model)
    _assert_tree_equal(opt.state_dict(), _scaled_lrs(want_opt, 0.5))
    if sched is not None:
        got = sched.state_dict()
        assert got["base_lrs"] == [lr * 0.5 for lr in want_sched["base_lrs"]]
        assert got["last_epoch"] == want_sched["last_epoch"]
    if where == "disk":
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rollback-step0.pt", "rollback-step3.pt"]


def test_a_second_restore_of_the_same_snapshot_is_still_exact():
    """The optimizer updates its state in place; the snapshot must not share those tensors."""
    model, opt, sched, gen = _setup(3, "adam", None)
    rb = Rollback(model, opt, every=1, max_retries=5)
    _train_step(model, opt, sched, gen)
    rb.maybe_snapshot(0)
    rb.confirm(1)
    want_model, want_opt = _clone(model.state_dict()), _clone(opt.state_dict())
    rb.restore(_decision(2), step=2)
    for step in range(2, 5):
        _train_step(model, opt, sched, gen)
    rb.restore(_decision(5), step=5)
    _assert_tree_equal(model.state_dict(), want_model)
    _assert_tree_equal(opt.state_dict(), _scaled_lrs(want_opt, 0.25))  # second consecutive retry: 0.5**2


def test_divergence_before_any_confirmed_snapshot_restores_the_initial_state():
    model, opt, sched, gen = _setup(5, "sgd", None)
    want = _clone(model.state_dict())
    rb = Rollback(model, opt, every=100)
    for step in range(3):
        _train_step(model, opt, sched, gen)
        rb.maybe_snapshot(step)  # step 0 is pending, never confirmed
    result = rb.restore(_decision(1), step=2)  # the parameters after step 0 gave a bad loss at step 1
    assert result.restored_step == -1 and result.undone_steps == range(0, 3)
    _assert_tree_equal(model.state_dict(), want)


def test_pending_snapshots_before_the_decision_count_as_cleared():
    model, opt, sched, gen = _setup(6, "sgd", None)
    rb = Rollback(model, opt, every=2, keep=3)
    for step in range(7):
        _train_step(model, opt, sched, gen)
        rb.maybe_snapshot(step)
    assert rb.pending_steps == (0, 2, 4) and rb.good_steps == (-1,)  # step 6 skipped: keep=3 pending max
    result = rb.restore(_decision(4), step=6)
    assert result.restored_step == 2  # 0 and 2 were judged clean by records 1 and 3; 4 is abandoned
    assert rb.pending_steps == () and rb.good_steps == (-1, 0, 2)


def test_keep_bounds_good_snapshots():
    model, opt, sched, gen = _setup(7, "sgd", None)
    rb = Rollback(model, opt, every=1, keep=2)
    for step in range(5):
        rb.maybe_snapshot(step)
        rb.confirm(step + 1)
    assert rb.good_steps == (3, 4)


def test_stale_decisions_after_a_restore_do_nothing():
    model, opt, sched, gen = _setup(8, "sgd", None)
    rb = Rollback(model, opt, every=1)
    rb.maybe_snapshot(0)
    rb.confirm(1)
    assert rb.restore(_decision(3), step=5) is not None
    assert rb.is_stale(4) and rb.is_stale(5) and not rb.is_stale(6)
    assert rb.restore(_decision(4), step=6) is None
    assert rb.retries == 1


def test_retries_raise_when_exhausted_and_reset_after_progress():
    model, opt, sched, gen = _setup(9, "sgd", None)
    rb = Rollback(model, opt, every=1, max_retries=2)
    rb.restore(_decision(1), step=1)
    rb.restore(_decision(2), step=2)
    with pytest.raises(TrainingDiverged, match="2 consecutive rollbacks") as info:
        rb.restore(_decision(3), step=3)
    assert info.value.step == 3 and info.value.metric == "loss"

    rb2 = Rollback(model, opt, every=1, max_retries=1)
    rb2.restore(_decision(1), step=1)
    rb2.maybe_snapshot(2)
    rb2.confirm(3)  # a snapshot newer than the restore proved good
    assert rb2.retries == 0
    assert rb2.restore(_decision(4), step=4).retry == 1


def test_exhausted_with_stop_reports_instead_of_raising():
    model, opt, sched, gen = _setup(10, "sgd", None)
    rb = Rollback(model, opt, max_retries=1, on_exhausted="stop")
    rb.restore(_decision(1), step=1)
    result = rb.restore(_decision(2), step=2)
    assert result.exhausted and "exhausted" in result.message


def test_skip_batches_counts_down():
    model, opt, sched, gen = _setup(12, "sgd", None)
    rb = Rollback(model, opt, skip_batches=2)
    assert not rb.should_skip()
    assert rb.restore(_decision(1), step=1).skip_next == 2
    assert [rb.should_skip() for _ in range(3)] == [True, True, False]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        pytest.param({"lr_factor": 0.0}, "lr_factor must be > 0", id="lr-factor-0"),
        pytest.param({"lr_factor": -0.5}, "lr_factor must be > 0", id="lr-factor-negative"),
        pytest.param({"lr_factor": 2.0}, r"\(0, 1\]", id="lr-factor-above-1"),
        pytest.param({"every": 0}, "every", id="every-0"),
        pytest.param({"keep": 0}, "keep", id="keep-0"),
        pytest.param({"max_retries": 0}, "max_retries", id="max-retries-0"),
        pytest.param({"skip_batches": -1}, "skip_batches", id="negative-skip"),
        pytest.param({"on_exhausted": "ignore"}, "on_exhausted", id="bad-on-exhausted"),
    ],
)
def test_bad_configuration_fails_at_construction(kwargs, needle):
    model, opt, _, _ = _setup(0, "sgd", None)
    with pytest.raises(ConfigError, match=needle):
        Rollback(model, opt, **kwargs)


def test_a_model_without_state_dict_is_rejected():
    model, opt, _, _ = _setup(0, "sgd", None)
    with pytest.raises(ConfigError, match="state_dict"):
        Rollback(object(), opt)  # type: ignore[arg-type]


def test_the_snapshot_behind_the_flagged_record_is_not_used():
    """The record of step d is the first loss of the parameters saved after d - 1: skip that snapshot."""
    model, opt, sched, gen = _setup(13, "sgd", None)
    rb = Rollback(model, opt, every=1, keep=5)
    for step in range(4):
        rb.maybe_snapshot(step)
    rb.confirm(4)
    assert rb.good_steps == (-1, 0, 1, 2, 3)
    assert rb.restore(_decision(3), step=4).restored_step == 1


def test_a_divergence_on_the_first_record_has_nothing_to_go_back_to():
    model, opt, _, _ = _setup(14, "sgd", None)
    with pytest.raises(TrainingDiverged, match="no good snapshot"):
        Rollback(model, opt).restore(_decision(0), step=0)
