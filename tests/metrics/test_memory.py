"""Memory: one allocator-stats lookup per step and a peak per flush interval (the CUDA
allocator's host-side counters are replaced by a recording stand-in on this CPU machine; the real
allocator is exercised by tests/metrics/test_builtin_gpu.py on a GPU)."""

from __future__ import annotations

import math

import pytest
import torch

import batchtap as bt
from batchtap.metrics import StepInputs
from tests.conftest import ListSink
from tests.metrics._helpers import TIMING

CUDA = torch.device("cuda", 0)


class _Allocator:
    """What the caching allocator's stats calls return, and how often they were made."""

    def __init__(self) -> None:
        self.current, self.peak = 1000, 5000
        self.lookups = 0
        self.resets: list[torch.device] = []

    def stats(self, device: torch.device) -> dict:
        self.lookups += 1
        return {"allocated_bytes": {"all": {"current": self.current, "peak": self.peak}}, "segment": {}}

    def reset_peak(self, device: torch.device) -> None:
        self.resets.append(device)
        self.peak = self.current


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> _Allocator:
    fake = _Allocator()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", fake.stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    return fake


def test_one_stats_lookup_per_step_and_the_peak_reset_at_each_flush(allocator: _Allocator) -> None:
    metric = bt.metrics.Memory()
    inputs = StepInputs(None, None, None, 8.0, device=CUDA)
    assert metric.read_host(inputs) == (1000.0, 5000.0)
    assert allocator.lookups == 1
    metric.on_flush()
    assert allocator.resets == [CUDA]
    allocator.current = 1500
    assert metric.read_host(inputs) == (1500.0, 1000.0)  # the peak since the flush
    assert allocator.lookups == 2


def test_process_peak_is_never_reset(allocator: _Allocator) -> None:
    metric = bt.metrics.Memory(peak="process")
    metric.read_host(StepInputs(None, None, None, 8.0, device=CUDA))
    metric.on_flush()
    assert allocator.resets == []


def test_off_cuda_memory_reports_nothing_and_reads_no_stats(allocator: _Allocator) -> None:
    metric = bt.metrics.Memory()
    raw = metric.read_host(StepInputs(torch.tensor(1.0), None, None, 8.0, device=torch.device("cpu")))
    assert all(math.isnan(v) for v in raw) and metric.finalize(raw, TIMING) == (None, None)
    metric.on_flush()
    assert allocator.lookups == 0 and allocator.resets == []


def test_bad_peak_mode_is_a_config_error() -> None:
    with pytest.raises(bt.ConfigError, match="Memory peak must be 'interval' or 'process', got 'max'"):
        bt.metrics.Memory(peak="max")


class _CountsFlushes(bt.metrics.Metric):
    host_width = 1

    def __init__(self) -> None:
        self.flushes = 0

    def outputs(self):  # type: ignore[no-untyped-def]
        return (bt.metrics.Output("flushes_seen", bt.metrics.ANY_FINITE, bt.metrics.Reduce.MAX),)

    def read_host(self, inputs):  # type: ignore[no-untyped-def]
        return (float(self.flushes),)

    def on_flush(self) -> None:
        self.flushes += 1


def test_the_tap_calls_on_flush_once_per_flush() -> None:
    counter = _CountsFlushes()
    sink = ListSink()
    with bt.Tap([bt.metrics.Loss(), counter], [sink], flush_every=5, flush_seconds=3600) as tap, tap.run():
        for _ in range(12):
            tap.step(loss=torch.tensor(1.0))
    assert counter.flushes == 3  # after steps 5 and 10, and the final flush of the last 2
    assert [r.values["flushes_seen"] for r in sink.records] == [0.0] * 5 + [1.0] * 5 + [2.0] * 2
