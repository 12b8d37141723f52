"""The engine: step order, warm-up, history, events, alert hooks, agreement, cleared steps."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchtap.errors import ConfigError, TrainingDiverged
from batchtap.records import EventKind
from batchtap.rules import Action, Anomaly, NonFinite, RuleEngine, Spike, Threshold

from ._helpers import rec, records

NAN = math.nan


def test_decisions_come_in_step_order_with_their_record_position():
    engine = RuleEngine([Threshold("accuracy", below=0.5), NonFinite("loss")])
    ds = engine.process([rec(0, loss=1.0, accuracy=0.9), rec(1, loss=NAN, accuracy=0.4), rec(2, loss=0.5)])
    assert [(d.step, d.rule) for d in ds] == [(1, "threshold(accuracy<0.5)"), (1, "nonfinite(loss)")]
    d = ds[1]
    assert (d.run_id, d.epoch, d.batch, d.rank, d.wall_time) == ("run", 0, 1, 0, 1.0)
    assert d.actions == (Action.STOP,) and d.metric == "loss" and math.isnan(d.value)


def test_recent_values_end_with_the_triggering_value():
    engine = RuleEngine([NonFinite()], history=3)
    (d,) = engine.process(records("loss", [0.1, 0.2, 0.3, 0.4, math.inf]))
    assert d.recent == (0.3, 0.4, math.inf)


def test_raise_decision_builds_training_diverged_with_step_metric_recent():
    engine = RuleEngine([NonFinite(action="raise")])
    (d,) = engine.process(records("loss", [0.5, NAN]))
    err = d.to_error()
    assert isinstance(err, TrainingDiverged) and err.step == 1 and err.metric == "loss"
    assert err.recent[0] == 0.5 and math.isnan(err.recent[1])


def test_warmup_delays_firing_but_not_learning():
    spike = Spike(ratio=3.0, min_samples=3, warmup=5)
    engine = RuleEngine([spike])
    # values before step 5 still build the baseline (EMA ~1), so the jump at 6 is judged against it
    assert [d.step for d in engine.process(records("loss", [1, 1, 9, 1, 1, 1, 9]))] == [6]


def test_one_anomaly_event_per_decision():
    engine = RuleEngine([NonFinite()])
    engine.process(records("loss", [NAN, 0.5, NAN]))
    events = engine.take_events()
    assert [(e.kind, e.step, e.metric) for e in events] == [
        (EventKind.ANOMALY, 0, "loss"),
        (EventKind.ANOMALY, 2, "loss"),
    ]
    assert "nonfinite(loss)" in events[0].message and "stop" in events[0].message
    assert engine.take_events() == []


def test_alert_hooks_run_in_order_and_a_failing_hook_becomes_a_warning():
    seen: list[str] = []

    def rule_hook(d):
        seen.append(f"rule:{d.step}")

    def broken(d):
        raise OSError("slack is down")

    engine = RuleEngine([Threshold("loss", above=1.0, on_alert=rule_hook)], on_alert=broken)
    assert len(engine.process(records("loss", [0.5, 2.0]))) == 1
    assert seen == ["rule:1"]
    kinds = [e.kind for e in engine.take_events()]
    assert kinds == [EventKind.ANOMALY, EventKind.WARNING]


def test_alert_hook_only_for_alert_actions():
    seen = []
    engine = RuleEngine([NonFinite(action="stop", on_alert=seen.append)])
    engine.process(records("loss", [NAN]))
    assert seen == []


def test_callables_become_alert_rules_with_history_before_the_record():
    seen = []

    def rising(record, history):
        seen.append(history["loss"])
        prev = history["loss"]
        if prev and record.values["loss"] > prev[-1]:
            return Anomaly("loss", "went up", record.values["loss"])
        return None

    engine = RuleEngine([rising])
    ds = engine.process(records("loss", [3.0, 2.0, 2.5]))
    assert [(d.step, d.rule, d.actions) for d in ds] == [(2, "rising", (Action.ALERT,))]
    assert seen == [(), (3.0,), (3.0, 2.0)]


def test_cleared_through_stops_before_a_blocking_decision_then_moves_on():
    engine = RuleEngine([NonFinite(), Threshold("loss", above=5.0)])  # stop + alert
    assert engine.cleared_through == -1
    engine.process(records("loss", [1.0, 6.0, 1.0]))  # alert only: not blocking
    assert engine.cleared_through == 2
    engine.process(records("loss", [1.0, NAN, 1.0], start=3))
    assert engine.cleared_through == 3
    engine.process(records("loss", [1.0, 1.0], start=6))
    assert engine.cleared_through == 7


def test_agreement_makes_another_ranks_anomaly_act_here():
    calls = []

    def any_rank(step, flags):
        calls.append((step, list(flags)))
        return [True] * len(flags) if step == 1 else flags  # pretend rank 1 saw NaN at step 1

    engine = RuleEngine([NonFinite()], agree=any_rank)
    ds = engine.process(records("loss", [1.0, 1.0, 1.0]))
    assert [d.step for d in ds] == [1] and "another rank" in ds[0].message
    assert calls == [(0, [False]), (1, [False]), (2, [False])]


def test_actions_lists_what_rules_may_do():
    engine = RuleEngine([NonFinite(action=["alert", "rollback"]), Threshold("loss", above=1.0)])
    assert engine.actions == {Action.ALERT, Action.ROLLBACK}


def test_reset_forgets_rule_state_and_history():
    spike = Spike(ratio=2.0, min_samples=2)
    engine = RuleEngine([spike])
    engine.process(records("loss", [1.0, 1.0]))
    engine.reset()
    assert engine.history["loss"] == ()
    assert engine.process(records("loss", [5.0], start=2)) == []  # no baseline any more


@pytest.mark.parametrize(
    ("rules", "needle"),
    [
        pytest.param([NonFinite(), NonFinite()], "unique", id="duplicate-names"),
        pytest.param([42], "Rule or a callable", id="not-a-rule"),
    ],
)
def test_bad_rule_sets_fail_at_construction(rules, needle):
    with pytest.raises(ConfigError, match=needle):
        RuleEngine(rules)


@settings(derandomize=True, deadline=None, max_examples=100)
@given(st.lists(st.floats(0.01, 10.0), max_size=100), st.integers(1, 30))
def test_block_boundaries_do_not_change_decisions(values, block):
    """The pipeline hands records in flush-sized blocks; the decisions must not depend on them."""

    def run(chunk):
        engine = RuleEngine([Spike(ratio=2.0, min_samples=3), Threshold("loss", above=8.0, patience=2)])
        recs, out = records("loss", values), []
        for i in range(0, len(recs), chunk):
            out += [(d.step, d.rule) for d in engine.process(recs[i : i + chunk])]
        return out

    assert run(block) == run(max(1, len(values)))


@pytest.mark.parametrize("history", [0, -3, True, 2.5], ids=["zero", "negative", "bool", "float"])
def test_history_must_be_a_positive_integer(history: object) -> None:
    with pytest.raises(ConfigError, match=rf"RuleEngine: history must be an integer >= 1, got {history!r}"):
        RuleEngine([], history=history)  # type: ignore[arg-type]
