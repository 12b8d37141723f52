"""GpuStarved: a GPU below its utilisation threshold while the data loader's wait is a large
share of the step fires once per ``patience`` records, naming the data loader."""

from __future__ import annotations

import math
import time

import pytest
import torch

import batchtap as bt
from batchtap.metrics.system import System
from batchtap.records import Record
from batchtap.rules import GpuStarved, History
from tests.conftest import ListSink
from tests.metrics.test_system import fake_nvml


def _record(step: int, **values: float) -> Record:
    return Record("r", step, 0, step, 0, 0.0, values)


def _fires(rule: GpuStarved, records: list[Record]) -> list[int]:
    fired = []
    for r in records:
        if rule.metric not in r.values:
            continue
        anomaly = rule.check(r, History())
        rule.update(r, fired=anomaly is not None)
        if anomaly is not None:
            fired.append(r.step)
    return fired


@pytest.mark.parametrize(
    ("util", "data", "step", "fires"),
    [
        pytest.param(12.0, 0.035, 0.015, True, id="starved"),
        pytest.param(80.0, 0.035, 0.015, False, id="busy-gpu"),
        pytest.param(12.0, 0.001, 0.015, False, id="low-util-but-no-data-wait"),
    ],
)
def test_fires_only_when_low_utilisation_and_data_wait_come_together(
    util: float, data: float, step: float, fires: bool
) -> None:
    rule = GpuStarved(patience=3, warmup=0)
    records = [_record(s, gpu0_util=util, data_time=data, step_time=step) for s in range(7)]
    assert _fires(rule, records) == ([2, 5] if fires else [])


def test_missing_or_nan_values_neither_count_nor_break_a_streak() -> None:
    rule = GpuStarved(patience=3, warmup=0)
    starved = {"gpu0_util": 5.0, "data_time": 0.05, "step_time": 0.01}
    records = [
        _record(0, **starved),
        _record(1, **{**starved, "gpu0_util": math.nan}),
        _record(2, gpu0_util=5.0),  # no loader watched at this step
        _record(3, **starved),
        _record(4, **starved),
    ]
    assert _fires(rule, records) == [4]


def test_the_message_names_the_data_loader_and_the_fix() -> None:
    rule = GpuStarved(device=1, patience=1, warmup=0)
    anomaly = rule.check(_record(9, gpu1_util=3.0, data_time=0.09, step_time=0.01), History())
    assert anomaly is not None and anomaly.metric == "gpu1_util"
    assert anomaly.message.startswith("GPU 1 utilisation 3% while the data loader wait is 90% of the step")
    assert "the data loader is the bottleneck" in anomaly.message and "num_workers" in anomaly.message


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(bt.ConfigError, match=r"data_share must be a share of the step in \(0, 1\), got 30"):
        GpuStarved(data_share=30)


def test_a_slow_loader_beside_an_idle_gpu_raises_an_alert_naming_the_loader() -> None:
    system = System(nvml=fake_nvml({0: [4.0]}), interval=0.005)
    assert system.sampler.wait_for(2, timeout=30)

    def slow_loader():  # the loader keeps the (idle) GPU waiting
        for _ in range(12):
            time.sleep(0.01)
            yield torch.randn(8, 4), torch.randint(0, 3, (8,))

    sink = ListSink()
    model = torch.nn.Linear(4, 3)
    rules = [GpuStarved(patience=5, warmup=0)]
    with bt.Tap([bt.metrics.Loss(), bt.metrics.StepTime(), bt.metrics.DataTime(), system], [sink], rules=rules) as tap:
        with tap.run("starved"):
            for x, y in tap.watch(slow_loader()):
                tap.step(loss=torch.nn.functional.cross_entropy(model(x), y).detach())
    alerts = [e for e in sink.events if e.metric == "gpu0_util"]
    assert alerts and all("data loader is the bottleneck" in e.message for e in alerts), sink.events
    assert alerts[0].message.startswith("gpu_starved(gpu0)") and alerts[0].message.endswith("-> alert")
