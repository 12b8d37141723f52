"""ActionRunner on the training side, and the whole rules loop driven the way the Tap will drive it."""

from __future__ import annotations

import math

import pytest
import torch

from batchtap.errors import ConfigError, TrainingDiverged
from batchtap.records import EventKind, Record
from batchtap.recovery import ActionRunner, Rollback
from batchtap.rules import Action, Decision, NonFinite, RuleEngine, Spike, Threshold
from tests.rules._helpers import records

NAN = math.nan


def _decision(step: int, *actions: str) -> Decision:
    return Decision(step=step, rule="r", metric="loss", actions=tuple(Action(a) for a in actions), message="bad")


def test_stop_is_sticky_and_keeps_the_first_reason():
    runner = ActionRunner([Action.STOP])
    out = runner.apply([_decision(3, "stop"), _decision(4, "stop")], step=5)
    assert out.stop and out.reason == "r at step 3: bad"
    assert runner.apply([], step=6).stop is False and runner.stop_requested
    assert runner.stop_reason == "r at step 3: bad"
    assert [e.kind for e in runner.take_events()] == [EventKind.ACTION, EventKind.ACTION]


def test_raise_raises_training_diverged_after_queuing_its_event():
    runner = ActionRunner([Action.RAISE])
    engine = RuleEngine([NonFinite(action="raise")])
    ds = engine.process(records("loss", [0.3, NAN]))
    with pytest.raises(TrainingDiverged) as info:
        runner.apply(ds, step=2)
    assert (info.value.step, info.value.metric, info.value.recent[0]) == (1, "loss", 0.3)
    assert "raise TrainingDiverged" in runner.take_events()[0].message


def test_alert_only_decisions_change_nothing_on_the_training_side():
    runner = ActionRunner([Action.ALERT])
    out = runner.apply([_decision(1, "alert")], step=2)
    assert not out.stop and runner.take_events() == []


def test_rollback_without_a_rollback_object_is_a_config_error():
    with pytest.raises(ConfigError, match="no Rollback"):
        ActionRunner(RuleEngine([Spike(action="rollback")]))


def test_decisions_about_an_abandoned_trajectory_are_ignored_with_an_event():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    rb = Rollback(model, torch.optim.SGD(model.parameters(), lr=0.1), every=1)
    runner = ActionRunner([Action.ROLLBACK, Action.STOP], rollback=rb)
    out = runner.apply([_decision(5, "rollback"), _decision(6, "stop")], step=8)
    assert len(out.rollbacks) == 1 and out.ignored == 1 and not out.stop
    assert "abandoned" in runner.take_events()[-1].message


def test_skipped_batches_are_named_in_one_event():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    rb = Rollback(model, torch.optim.SGD(model.parameters(), lr=0.1), skip_batches=2)
    runner = ActionRunner([Action.ROLLBACK], rollback=rb)
    runner.apply([_decision(3, "rollback")], step=4)
    runner.take_events()
    assert [runner.should_skip(1, b, step=5) for b in (7, 8, 9)] == [True, True, False]
    (event,) = runner.take_events()
    assert event.message == "rollback 1: skipped batches (epoch:batch) 1:7, 1:8"


# ---- the whole loop -----------------------------------------------------------------------------


class FakeTap:
    """Drives engine and runner exactly as the Tap is meant to: records reach the rules in blocks of
    ``flush`` steps (the pipeline lag), and the training thread applies what came back at its next
    ``step()``, then lets the rollback snapshot."""

    def __init__(self, engine: RuleEngine, runner: ActionRunner, *, flush: int) -> None:
        self.engine, self.runner, self.flush = engine, runner, flush
        self.block: list[Record] = []
        self.inbox: list[tuple[list[Decision], int]] = []  # pipeline thread -> training thread
        self.events: list = []
        self.step_no = 0

    def step(self, loss: float, *, batch: int) -> None:
        k = self.step_no
        # training thread: apply what the pipeline sent since the last step
        for decisions, cleared in self.inbox:
            self.runner.apply(decisions, step=k, cleared_through=cleared)
        self.inbox.clear()
        self.events += self.runner.take_events()
        # capture (no rules yet) ...
        self.block.append(Record("run", step=k, epoch=0, batch=batch, rank=0, wall_time=0.0, values={"loss": loss}))
        # ... and a flush: the pipeline thread runs the rules on the block
        if len(self.block) == self.flush:
            decisions = self.engine.process(self.block)
            self.events += self.engine.take_events()
            self.inbox.append((decisions, self.engine.cleared_through))
            self.block = []
        self.runner.after_step(k)
        self.step_no += 1

    @property
    def should_stop(self) -> bool:
        return self.runner.stop_requested


def _regression(seed: int, n_batches: int):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(4, 1, generator=g)
    xs = [torch.randn(32, 4, generator=g) for _ in range(n_batches)]
    return [(x, x @ w_true + 0.01 * torch.randn(32, 1, generator=g)) for x in xs]


def test_nan_stops_within_two_steps_of_the_lag():
    torch.manual_seed(1)
    engine = RuleEngine([NonFinite()])
    tap = FakeTap(engine, ActionRunner(engine), flush=1)
    stopped_at = None
    for k in range(20):
        tap.step(NAN if k == 7 else 1.0, batch=k)
        if tap.should_stop:
            stopped_at = k
            break
    assert stopped_at == 8  # flagged at 7, acted on at the next step


def test_a_scripted_divergence_recovers_by_rollback_and_finishes_finite():
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rb = Rollback(model, opt, every=4, keep=2, lr_factor=0.5, skip_batches=2, max_retries=2)
    engine = RuleEngine([NonFinite(action="rollback"), Spike(ratio=5.0, min_samples=5, action="rollback")])
    runner = ActionRunner(engine, rollback=rb)
    tap = FakeTap(engine, runner, flush=4)
    skipped, losses, poisoned = [], [], False
    for b, (x, y) in enumerate(_regression(3, 120)):
        if runner.should_skip(0, b, step=tap.step_no):
            skipped.append(b)
            continue
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if tap.step_no == 40 and not poisoned:  # a corrupted update: the loss explodes from step 41
            poisoned = True
            with torch.no_grad():
                model.weight.mul_(1e3)
        tap.step(loss.item(), batch=b)  # .item() is the test's shortcut for the capture ring
        losses.append(loss.item())

    (result,) = rb.results
    assert result.diverged_step == 41 and result.restored_step == 36 and result.retry == 1
    assert result.lrs == (0.025,)
    assert math.isfinite(losses[-1]) and losses[-1] < 0.01
    named = [e.message for e in tap.events if e.kind is EventKind.ACTION and "skipped batches" in e.message]
    assert named == [f"rollback 1: skipped batches (epoch:batch) {', '.join(f'0:{b}' for b in skipped)}"]
    assert len(skipped) == 2 and not runner.stop_requested


def test_a_run_that_keeps_diverging_raises_after_max_retries():
    torch.manual_seed(4)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rb = Rollback(model, opt, every=2, max_retries=2)
    engine = RuleEngine([Threshold("loss", above=1e6, action="rollback")])
    tap = FakeTap(engine, ActionRunner(engine, rollback=rb), flush=2)
    with pytest.raises(TrainingDiverged, match="2 consecutive rollbacks"):
        for k in range(100):
            tap.step(1e9 if k >= 10 else 1.0, batch=k)  # every step from 10 on is "diverged"
