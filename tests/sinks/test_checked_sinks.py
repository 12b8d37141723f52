"""Wrong-type ``sinks=`` and ``metrics=`` get an error naming what was expected, what arrived and
the fix (a path names the sink that stores there), before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

import batchtap as bt
from batchtap._defaults import checked_metrics, checked_sinks
from batchtap.errors import ConfigError


@pytest.mark.parametrize(
    ("sinks", "message"),
    [
        pytest.param(["runs/x.db"], r"sinks\[0\] must be a batchtap.sinks.Sink, got the path 'runs/x.db'; fix: bt.sinks.SQLite\('runs/x.db'\)", id="db-path"),
        pytest.param([Path("m.jsonl")], r"got the path 'm.jsonl'; fix: bt.sinks.JSONL\('m.jsonl'\)", id="jsonl-path"),
        pytest.param(["postgresql://u@h/db"], r"fix: bt.sinks.Postgres\(URL\)", id="postgres-url"),
        pytest.param("runs/x.db", r"sinks must be a list of sinks, got the path 'runs/x.db'; fix: sinks=\[bt.sinks.SQLite\('runs/x.db'\)\]", id="one-path"),
        pytest.param(bt.sinks.Console(), r"sinks must be a list of sinks, got a single Console; fix: sinks=\[Console\(...\)\]", id="one-sink"),
        pytest.param([print], r"sinks\[0\] must be a batchtap.sinks.Sink object, got builtin_function_or_method; fix: a built-in sink", id="callable"),
        pytest.param(3, r"sinks must be a list of batchtap.sinks.Sink objects, got int", id="number"),
    ],
)  # fmt: skip
def test_wrong_sinks_name_the_fix(sinks: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        checked_sinks(sinks, None, rank=0)  # type: ignore[arg-type]


def test_the_tap_refuses_a_path_for_a_sink_before_running() -> None:
    with pytest.raises(ConfigError, match=r"fix: bt.sinks.SQLite\('runs/x.db'\)"):
        bt.Tap(sinks=["runs/x.db"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        pytest.param(bt.metrics.Loss(), r"metrics must be a list of metrics, got a single Loss; fix: metrics=\[bt.metrics.Loss\(...\)\]", id="one-metric"),
        pytest.param([bt.metrics.Loss], r"metrics\[0\] must be a batchtap.metrics.Metric object, got <class .*Loss'> \(a class: call it\)", id="class"),
        pytest.param(["loss"], r"metrics\[0\] must be a batchtap.metrics.Metric object, got 'loss'; fix: e.g. bt.metrics.Loss\(\)", id="name"),
        pytest.param("loss", r"metrics must be a list of batchtap.metrics.Metric objects, got str", id="string"),
    ],
)  # fmt: skip
def test_wrong_metrics_name_the_fix(metrics: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        checked_metrics(metrics)


def test_a_list_of_metrics_passes_as_a_list() -> None:
    loss = bt.metrics.Loss()
    assert checked_metrics((loss,)) == [loss]
