"""Actions parsing, History, function rules."""

from __future__ import annotations

import pytest

from batchtap.errors import ConfigError
from batchtap.rules import Action, Anomaly, CallableRule, History
from batchtap.rules.base import parse_actions

from ._helpers import rec


def test_actions_accept_names_enums_and_sequences_without_duplicates():
    assert parse_actions(["stop", Action.STOP, "alert"], rule="r") == (Action.STOP, Action.ALERT)
    assert parse_actions(Action.RAISE, rule="r") == (Action.RAISE,)


def test_unknown_action_names_the_known_ones():
    with pytest.raises(ConfigError, match="'rollback'.*Fix"):
        parse_actions("rewind", rule="r")


def test_history_keeps_a_bounded_window_per_metric():
    h = History(maxlen=3)
    for step in range(5):
        h.append(rec(step, loss=float(step), accuracy=step / 10))
    assert h["loss"] == (2.0, 3.0, 4.0)
    assert h["accuracy"] == (0.2, 0.3, 0.4)
    assert h["missing"] == ()
    assert "loss" in h and h.last_step == 4
    h.clear()
    assert h["loss"] == () and h.last_step is None


def test_history_rejects_an_empty_window():
    with pytest.raises(ConfigError, match="maxlen"):
        History(maxlen=0)


def test_callable_rule_must_return_an_anomaly():
    rule = CallableRule(lambda r, h: "bad", name="bad")
    with pytest.raises(TypeError, match="Anomaly or None"):
        rule.check(rec(0, loss=1.0), History())


def test_callable_rule_rejects_non_callables():
    with pytest.raises(ConfigError, match="callable"):
        CallableRule(3)  # type: ignore[arg-type]


def test_callable_rule_sees_every_record():
    rule = CallableRule(lambda r, h: Anomaly("x", "always"), action="stop")
    assert rule.applies_to(rec(0)) and rule.actions == (Action.STOP,)
