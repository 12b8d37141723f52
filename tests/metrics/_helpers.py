"""Calling a metric the way the Tap does, one step at a time, with the host reads counted."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchtap.metrics import Combine, Metric, StepInputs, StepTiming

TIMING = StepTiming(samples=8.0, step_time=0.25, data_time=math.nan)


class CountOps(TorchDispatchMode):
    """Every aten op run inside, and the device->host reads among them (``.item()``, ``bool(t)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def host_reads(self) -> list[str]:
        return [op for op in self.ops if "_local_scalar_dense" in op]


def device_values(metric: Metric, inputs: StepInputs) -> list[torch.Tensor]:
    """``compute`` as the Tap runs it (no grad, no host reads allowed), checked for shape."""
    with torch.no_grad(), CountOps() as counted:
        values = list(metric.compute(inputs))
    assert counted.host_reads == [], f"{type(metric).__name__}.compute read the device: {counted.host_reads}"
    assert len(values) == metric.device_width
    row = torch.empty(len(values), dtype=torch.float32)
    if values:
        assert all(v.dim() == 0 for v in values)
        torch.stack([v.to(row.device) for v in values], out=row)  # as the ring writes a row
    return row.tolist()


def raw(metric: Metric, inputs: StepInputs) -> list[float]:
    """The raw columns of one step: device then host."""
    host = list(metric.read_host(inputs))
    assert len(host) == metric.host_width
    return device_values(metric, inputs) + host


def step(metric: Metric, inputs: StepInputs, timing: StepTiming = TIMING) -> list[float | None]:
    """The values ``metric`` reports for one step."""
    return list(metric.finalize(raw(metric, inputs), timing))


def accumulated(metric: Metric, micro: Sequence[StepInputs]) -> list[float]:
    """The raw columns of an optimizer step of several micro-batches, combined as ``combine()``
    declares (what ``Tap.accumulate`` does on the device), host columns from the last one."""
    kinds = metric.combine()
    assert len(kinds) == metric.device_width
    rows = [device_values(metric, inputs) for inputs in micro]
    weights = [inputs.batch_size for inputs in micro]
    out = []
    for col, kind in enumerate(kinds):
        column = [row[col] for row in rows]
        if kind is Combine.SUM:
            out.append(math.fsum(column))
        elif kind is Combine.MEAN:
            out.append(math.fsum(v * w for v, w in zip(column, weights)) / math.fsum(weights))
        elif kind is Combine.MIN:
            out.append(min(column))
        else:
            out.append(max(column))
    return out + list(metric.read_host(micro[-1]))
