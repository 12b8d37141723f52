"""Rules over per-layer metrics: a glob of metric names on Spike / Threshold / NonFinite (one state
per matched name, the decision names the layer), LayerRatio's bounds and streaks, and both acting
in a real loop on Layers' values (stop, alert event), through a pipeline process too."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from batchtap.errors import ConfigError
from batchtap.rules import LayerRatio, MetricGlob, NonFinite, RuleEngine, Spike, Threshold
from tests.conftest import ListSink
from tests.rules._helpers import rec


def test_spike_glob_keeps_one_baseline_per_layer_and_names_the_layer() -> None:
    rule = Spike("grad_norm/*", ratio=3.0, min_samples=3)
    assert isinstance(rule, MetricGlob) and rule.name == "spike(grad_norm/*)"
    # layer "a" lives around 1, layer "b" around 100: 50 is no spike for b, a big one for a
    steps = [rec(i, loss=1.0, **{"grad_norm/a": 1.0 + 0.01 * i, "grad_norm/b": 100.0}) for i in range(5)]
    steps.append(rec(5, loss=1.0, **{"grad_norm/a": 1.0, "grad_norm/b": 50.0}))
    steps.append(rec(6, loss=1.0, **{"grad_norm/a": 50.0, "grad_norm/b": 100.0}))
    decisions = RuleEngine([rule]).process(steps)
    assert [(d.step, d.metric) for d in decisions] == [(6, "grad_norm/a")]
    assert decisions[0].message.startswith("grad_norm/a 50 > 3 x EMA")
    assert decisions[0].rule == "spike(grad_norm/*)"


def test_threshold_glob_patience_is_per_layer_and_several_layers_fire_together() -> None:
    rule = Threshold("update_ratio/*", above=0.1, patience=2)
    seq = [
        rec(0, **{"update_ratio/x": 0.5, "update_ratio/y": 0.01}),
        rec(1, **{"update_ratio/x": 0.01, "update_ratio/y": 0.5}),  # x's streak broken; y starts
        rec(2, **{"update_ratio/x": 0.5, "update_ratio/y": 0.5}),  # y: 2 in a row
        rec(3, **{"update_ratio/x": 0.5, "update_ratio/y": 0.5}),  # x: 2 in a row; y fired: starts again
        rec(4, **{"update_ratio/x": 0.5, "update_ratio/y": 0.5, "loss": 1.0}),  # y: 2 again; x fired at 3
    ]
    decisions = RuleEngine([rule]).process(seq)
    assert [(d.step, d.metric) for d in decisions] == [
        (2, "update_ratio/y"),
        (3, "update_ratio/x"),
        (4, "update_ratio/y"),
    ]


def test_glob_fires_once_per_record_naming_the_others() -> None:
    rule = NonFinite("grad_norm/*", action="alert")
    decisions = RuleEngine([rule]).process([rec(0, **{"grad_norm/a": float("inf"), "grad_norm/b": float("nan")})])
    assert len(decisions) == 1
    assert decisions[0].metric == "grad_norm/a"
    assert decisions[0].message == "grad_norm/a is inf at step 0 (expected a finite value) (also grad_norm/b)"


def test_plain_names_are_unchanged_and_globs_pickle() -> None:
    assert type(Spike("loss")) is Spike and type(Threshold(metric="loss", above=1.0)) is Threshold
    assert type(Spike()) is Spike
    rule = Threshold("grad_norm/*", above=1.0)
    rule.check(rec(0, **{"grad_norm/a": 2.0}), bt.rules.History())
    copy = pickle.loads(pickle.dumps(rule))
    assert copy.name == rule.name and copy.check(rec(1, **{"grad_norm/b": 3.0}), bt.rules.History()) is not None
    with pytest.raises(ConfigError, match="expected below= or above="):
        Threshold("grad_norm/*")  # the arguments are checked when the rule is made, not at the first match


def test_layer_ratio_bounds_streaks_and_messages() -> None:
    rule = LayerRatio(max=0.1, min=1e-6, patience=2)
    seq = [
        rec(0, **{"update_ratio/emb": 1e-3, "update_ratio/head": 0.5}),
        rec(1, **{"update_ratio/emb": 1e-9, "update_ratio/head": 0.5}),
        rec(2, **{"update_ratio/emb": 1e-9, "update_ratio/head": 1e-3}),
    ]
    decisions = RuleEngine([rule]).process(seq)
    assert [(d.step, d.metric) for d in decisions] == [(1, "update_ratio/head"), (2, "update_ratio/emb")]
    assert decisions[0].message == (
        "layer head: update_ratio 0.5 > max 0.1 for 2 captured steps at step 1 (its weights move too fast)"
    )
    assert decisions[1].message == (
        "layer emb: update_ratio 1e-09 < min 1e-06 for 2 captured steps at step 2 (it stopped learning)"
    )
    assert not rule.applies_to(rec(3, loss=1.0))  # a row Layers did not capture
    with pytest.raises(ConfigError, match="expected max= or min="):
        LayerRatio()
    with pytest.raises(ConfigError, match="min=0.5 is greater than max=0.1"):
        LayerRatio(max=0.1, min=0.5)


def _loop(sink: bt.sinks.Sink, rules: list, *, pipeline: str = "thread", steps: int = 12) -> int:
    """Runs the loop until the Tap says stop; the number of steps run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    # the last layer takes huge steps (its update ratio explodes), the first one none (lr 0: stalled)
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters(), "lr": 50.0}], lr=0.1
    )
    tap = bt.Tap(
        [bt.metrics.Loss(), bt.metrics.Layers(model, every=2)], [sink], flush_every=2, rules=rules, pipeline=pipeline
    )
    g = torch.Generator().manual_seed(1)
    with tap, tap.run(name="layer-rules"):
        for step in range(steps):
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            tap.step(loss=loss)
            tap.flush()  # the pipeline has judged every row so far: the verdict is here, no race
            if tap.should_stop:
                return step + 1
    return steps


@pytest.mark.parametrize("pipeline", ["thread", "process"])
def test_layer_ratio_stops_a_real_loop_naming_the_layer(tmp_path: Path, pipeline: str) -> None:
    path = tmp_path / "run.jsonl"
    ran = _loop(bt.sinks.JSONL(path), [LayerRatio(max=0.5, action="stop")], pipeline=pipeline)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    anomalies = [e for e in lines if e["type"] == "event" and e["kind"] == "anomaly"]
    assert anomalies, lines
    assert anomalies[0]["metric"] == "update_ratio/2" and anomalies[0]["step"] == 0
    assert "layer 2: update_ratio" in anomalies[0]["message"] and "-> stop" in anomalies[0]["message"]
    assert ran <= 2  # verdicts are applied at the step boundary after the one that fired


def test_layer_ratio_min_alerts_on_a_stalled_layer(sink: ListSink) -> None:
    _loop(sink, [LayerRatio(min=1e-8, action="alert")], steps=6)
    anomalies = [e for e in sink.events if e.kind is bt.EventKind.ANOMALY]
    assert [e.step for e in anomalies] == [0, 2, 4]  # the captured steps only
    assert all(e.metric == "update_ratio/0" and "it stopped learning" in e.message for e in anomalies)
