"""bt.metrics.System: GPU values through a fake NVML module that follows NVML's API (pynvml's
function names, structures and errors; a utilisation series with known dips), the process and
host values through psutil for real; per-step means and minima aligned by the step clocks."""

from __future__ import annotations

import math
import pickle
import types

import pytest
import torch

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from batchtap.metrics.base import StepInputs, StepTiming
from batchtap.metrics.system import System
from tests.conftest import ListSink

TIMING = StepTiming(samples=8.0, step_time=0.01, data_time=math.nan)


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 (pynvml's own name)
    pass


def fake_nvml(util: dict[int, list[float]], *, power_supported: tuple[int, ...] = (0,)) -> types.SimpleNamespace:
    """A module with pynvml's calls: utilisation follows ``util[device]`` one sample at a time
    (the last value repeats), memory used grows by 1 MiB a call, device 1 has no power reading."""
    calls = {d: 0 for d in util}

    def handle(i: int) -> types.SimpleNamespace:
        if i not in util:
            raise NVMLError(f"Invalid Argument: device {i}")
        return types.SimpleNamespace(index=i)

    def utilisation(h: types.SimpleNamespace) -> types.SimpleNamespace:
        series = util[h.index]
        value = series[min(calls[h.index], len(series) - 1)]
        calls[h.index] += 1
        return types.SimpleNamespace(gpu=int(value), memory=5)  # c_nvmlUtilization_t

    def memory(h: types.SimpleNamespace) -> types.SimpleNamespace:
        used = (1000 + calls[h.index]) * 2**20
        return types.SimpleNamespace(total=16 * 2**30, used=used, free=16 * 2**30 - used)  # c_nvmlMemory_t

    def power(h: types.SimpleNamespace) -> int:
        if h.index not in power_supported:
            raise NVMLError_NotSupported("Not Supported")
        return 250_000  # milliwatts

    return types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(util),
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetUtilizationRates=utilisation,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetTemperature=lambda h, sensor: 61 if sensor == 0 else 0,
        nvmlDeviceGetClockInfo=lambda h, kind: 1410 if kind == 1 else 0,
    )


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _sample_at(system: System, clock: Clock, times: list[float]) -> None:
    for t in times:
        clock.t = t
        system.sampler.sample()


def _step_at(system: System, clock: Clock, t: float) -> dict[str, float | None]:
    clock.t = t
    raw = system.read_host(StepInputs(None, None, None, 8.0))
    return dict(zip([o.name for o in system.outputs()], system.finalize(raw, TIMING)))


def test_per_step_mean_and_min_over_the_step_interval_with_known_dips() -> None:
    clock = Clock()
    dips = [90, 90, 90, 10, 90, 90, 90, 90, 40, 90]  # samples at 0.1 .. 1.0; dips at 0.4 and 0.9
    system = System(nvml=fake_nvml({0: dips, 1: [50] * 10}), clock=clock, background=False)
    _sample_at(system, clock, [round(0.1 * k, 1) for k in range(1, 11)])
    first = _step_at(system, clock, 0.35)  # no step before it: the sample enclosing its end (0.3)
    assert (first["gpu0_util"], first["gpu0_util_min"]) == (90, 90)
    step = _step_at(system, clock, 0.75)  # samples 0.4, 0.5, 0.6, 0.7
    assert step["gpu0_util"] == pytest.approx((10 + 90 + 90 + 90) / 4) and step["gpu0_util_min"] == 10
    short = _step_at(system, clock, 0.78)  # shorter than the sampling period: the enclosing sample
    assert (short["gpu0_util"], short["gpu0_util_min"]) == (90, 90)
    late = _step_at(system, clock, 1.0)  # 0.8, 0.9, 1.0
    assert late["gpu0_util_min"] == 40 and late["gpu0_util"] == pytest.approx((90 + 40 + 90) / 3)
    assert late["gpu0_mem_total"] == 16 * 2**30 and late["gpu0_mem_used"] == pytest.approx(
        (1008 + 1009 + 1010) / 3 * 2**20
    )
    assert (late["gpu0_power"], late["gpu0_temp"], late["gpu0_sm_clock"]) == (250.0, 61.0, 1410.0)
    assert late["gpu1_power"] is None and late["gpu1_util"] == 50  # NotSupported: left out, not 0
    assert late["process_rss"] > 2**20 and late["host_ram_used"] > late["process_rss"]  # psutil, for real
    assert late["cpu_percent"] >= 0


def test_a_step_before_any_sample_has_no_values() -> None:
    clock = Clock()
    system = System(nvml=fake_nvml({0: [90]}), clock=clock, background=False)
    assert set(_step_at(system, clock, 5.0).values()) == {None}


def _train(tap: bt.Tap, steps: int) -> int:
    """Train ``steps`` steps; the host reads counted in ``tap.step`` after the first (which
    allocates the run's ring, once per run)."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    reads = 0
    for i in range(steps):
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == 0:
            tap.step(loss=loss, outputs=out, targets=y)
            continue
        with HostReadCounter() as counter:
            tap.step(loss=loss, outputs=out, targets=y)
        reads += counter.count
    return reads


def test_sampled_on_a_thread_of_its_own_and_stored_per_step_without_a_host_read() -> None:
    system = System(nvml=fake_nvml({0: [95, 95, 5] * 1000}), interval=0.005)
    assert system.sampler.wait_for(3, timeout=30)  # the thread samples before the first step
    sink = ListSink()
    with bt.Tap([*bt.metrics.default_metrics(), system], sinks=[sink], flush_every=10) as tap, tap.run("sys"):
        reads = _train(tap, 200)
        tap.flush()
    assert reads == 0
    steps = [r for r in sink.records if not r.sparse]
    assert len(steps) == 200
    for r in steps:
        assert 5 <= r.values["gpu0_util_min"] <= r.values["gpu0_util"] <= 95
        assert r.values["gpu0_power"] == 250.0 and r.values["process_rss"] > 0
    assert not [e for e in sink.events if e.kind.value == "warning"]


def test_without_nvml_the_gpu_values_are_absent_and_one_warning_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import batchtap.metrics.system as system_module

    monkeypatch.setattr(
        system_module, "_load_nvml", lambda: (None, "NVML could not start (NVMLError: driver not loaded)")
    )
    system = System(interval=0.005)
    assert [o.name for o in system.outputs()] == ["cpu_percent", "process_rss", "host_ram_used"]
    assert system.sampler.wait_for(1, timeout=30)
    sink = ListSink()
    with bt.Tap([bt.metrics.Loss(), system], sinks=[sink], flush_every=5) as tap, tap.run("cpu"):
        _train(tap, 20)
    warnings = [e for e in sink.events if e.kind.value == "warning"]
    assert len(warnings) == 1 and "GPU metrics left out: NVML could not start" in warnings[0].message
    assert all(not any(k.startswith("gpu") for k in r.values) and "process_rss" in r.values for r in sink.records)


def test_it_travels_to_another_process_and_samples_there() -> None:
    copy = pickle.loads(pickle.dumps(System(gpu=False, interval=0.005)))
    assert copy.sampler.wait_for(2, timeout=30)
    assert [o.name for o in copy.outputs()] == ["cpu_percent", "process_rss", "host_ram_used"]


def test_the_thread_ends_with_the_metric() -> None:
    import gc

    system = System(gpu=False, interval=0.005)
    sampler = system.sampler
    assert sampler.wait_for(1, timeout=30)
    thread = sampler._thread
    del system
    gc.collect()
    assert thread is not None
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(bt.ConfigError, match=r"interval must be > 0 seconds, got 0"):
        System(interval=0)
    with pytest.raises(bt.ConfigError, match=r"devices must be NVML indices in \[0, 1\), got 3"):
        System(nvml=fake_nvml({0: [1]}), devices=[3], background=False)


def test_a_short_step_gets_the_sample_enclosing_it_never_a_later_one() -> None:
    clock = Clock()
    system = System(nvml=fake_nvml({0: [10, 20, 30, 40]}), clock=clock, gpu=True, host=False, background=False)
    _sample_at(system, clock, [1.0, 2.0, 3.0, 4.0])
    assert _step_at(system, clock, 1.5)["gpu0_util"] == 10  # the first step: the sample at 1.0
    # steps shorter than the sampling period, inside [2, 3): each gets the sample taken at 2.0
    for end in (2.2, 2.5, 2.9):
        got = _step_at(system, clock, end)
        assert (got["gpu0_util"], got["gpu0_util_min"]) == (20, 20), end
    # a step ending exactly at a sample's time includes that sample, and only it
    assert _step_at(system, clock, 3.0)["gpu0_util"] == 30
    assert _step_at(system, clock, 3.5)["gpu0_util"] == 30  # after 3.0, before 4.0: the sample at 3.0


def test_failed_readings_are_left_out_of_a_steps_mean_not_counted_as_samples() -> None:
    clock = Clock()
    nvml = fake_nvml({0: [10, 20, 30, 40]})
    calls = {"power": 0}

    def flaky_power(h: types.SimpleNamespace) -> int:
        calls["power"] += 1
        if calls["power"] % 2 == 0:  # every second reading fails (a busy driver)
            raise NVMLError("Unknown Error")
        return 100_000 * calls["power"]  # 100 W, 300 W

    nvml.nvmlDeviceGetPowerUsage = flaky_power
    system = System(nvml=nvml, clock=clock, host=False, background=False)
    _sample_at(system, clock, [1.0, 2.0, 3.0, 4.0])
    _step_at(system, clock, 4.0)  # the first step: its end's sample only
    _sample_at(system, clock, [5.0, 6.0, 7.0, 8.0])  # power readings 5 (500 W), 6 fails, 7 (700 W), 8 fails
    step = _step_at(system, clock, 8.0)
    assert step["gpu0_power"] == pytest.approx((500.0 + 700.0) / 2)  # not (500 + 700) / 4
    assert step["gpu0_util"] == 40  # its readings never failed: all four samples
