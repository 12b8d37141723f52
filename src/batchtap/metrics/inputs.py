"""Checking what a step was given: types, shapes, dtypes, devices and names, from metadata only.

Used by the capture side before it launches anything: a step whose inputs cannot be measured is
refused with an :class:`~batchtap.InputError` that says what was expected, what arrived and the fix,
and nothing of it is recorded. Inputs are checked once per :func:`signature` (types, shapes, dtypes,
devices; never values), so a loop whose steps look alike pays for the checks once.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import torch

from batchtap._names import check_storable
from batchtap.errors import ConfigError, InputError
from batchtap.metrics.base import Metric, StepInputs
from batchtap.metrics.scalars import Extra

__all__ = [
    "RESERVED_NAMES",
    "check_count",
    "check_extra_name",
    "check_metrics",
    "check_new_name",
    "check_scalar",
    "check_step_inputs",
    "declared_extras",
    "device_of",
    "meta",
    "overflow_message",
    "samples_of",
    "signature",
    "tensors_of",
    "width_mismatch",
]

#: Record fields that metric and extra names may not shadow.
RESERVED_NAMES = frozenset({"run_id", "step", "epoch", "batch", "rank", "wall_time"})


def check_step_inputs(
    inputs: StepInputs, metrics: Sequence[Metric], device: torch.device, call: str = "step()"
) -> None:
    """Every check of one call's inputs against the run's ``metrics`` and capture ``device``."""
    given = {k for k in ("loss", "outputs", "targets") if getattr(inputs, k) is not None}
    for metric in metrics:
        missing = metric.requires - given
        if missing:
            raise InputError(
                f"{type(metric).__name__} needs {', '.join(sorted(missing))}, but {call} got none; "
                f"pass {', '.join(f'{k}=...' for k in sorted(missing))} or remove the metric"
            )
    known = {m.name for m in metrics if isinstance(m, Extra)}
    for name in inputs.extra:
        if name not in known:
            raise InputError(
                f"extra {name!r} was not present at the run's first step, which fixes the columns; "
                f"declare it up front with Tap(extras={{{name!r}: 'tensor'}}), or log values that "
                f"come and go with tap.log({{{name!r}: value}})"
                + (" — it also clashes with a built-in name" if name in RESERVED_NAMES else "")
            )
    for label, tensor in tensors_of(inputs):
        if tensor.device != device:
            raise InputError(
                f"{label} is on {tensor.device} but this run captures on {device}; move it, "
                f"e.g. {label}.to({str(device)!r})"
            )
    for metric in metrics:
        metric.check(inputs)


def check_metrics(metrics: Sequence[Metric]) -> None:
    seen: set[str] = set()
    for metric in metrics:
        if not isinstance(metric, Metric):
            raise ConfigError(f"metrics must be batchtap.metrics.Metric objects, got {type(metric).__name__}")
        for output in metric.outputs():
            if output.name in seen or output.name in RESERVED_NAMES:
                raise ConfigError(
                    f"metric value name {output.name!r} is used twice or reserved; give the metric another name"
                )
            try:
                check_storable("metric value name", output.name)
            except InputError as exc:
                raise ConfigError(str(exc)) from None
            seen.add(output.name)


def declared_extras(
    extras: Mapping[str, Literal["tensor", "number"]] | Sequence[str], metrics: Sequence[Metric]
) -> dict[str, bool]:
    kinds = dict(extras) if isinstance(extras, Mapping) else {name: "tensor" for name in extras}
    taken = {o.name for m in metrics for o in m.outputs()}
    out: dict[str, bool] = {}
    for name, kind in kinds.items():
        if kind not in ("tensor", "number"):
            raise ConfigError(f"extras kind for {name!r} must be 'tensor' or 'number', got {kind!r}")
        try:
            check_extra_name(name, taken)
        except InputError as exc:
            raise ConfigError(str(exc)) from None
        out[name] = kind == "tensor"
    return out


def check_new_name(label: str, name: object, taken: Collection[str], clash: str) -> None:
    """A name a call introduces (an extra, a ``log()`` value): a non-empty storable string that no
    per-step value (``taken``) or record field already has; ``clash`` is the error then, with
    ``{name}`` filled in."""
    if not isinstance(name, str) or not name:
        raise InputError(f"{label}s must be non-empty strings, got {name!r}")
    check_storable(label, name)
    if name in taken or name in RESERVED_NAMES:
        raise InputError(clash.format(name=name))


def check_extra_name(name: object, taken: Collection[str]) -> None:
    check_new_name(
        "extra name",
        name,
        taken,
        "extra {name!r} clashes with a built-in metric or record field of the same name; rename it, "
        "e.g. 'extra_{name}'",
    )


def width_mismatch(metrics: Sequence[Metric], inputs: StepInputs) -> str:
    for metric in metrics:
        with torch.no_grad():
            device, host = len(metric.compute(inputs)), len(metric.read_host(inputs))
        if (device, host) != (metric.device_width, metric.host_width):
            return (
                f"{type(metric).__name__} declares device_width={metric.device_width}, "
                f"host_width={metric.host_width} but returned {device} device and {host} host values; "
                "make the declared widths match what compute() and read_host() return"
            )
    return "metrics returned a different number of values than they declare"


def _describe(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    return type(value)


def signature(inputs: StepInputs) -> tuple[Any, ...]:
    """What the input checks depend on: types, shapes, dtypes and devices (never values)."""
    # _describe written out for the three tensors every step and micro-batch passes (no calls)
    loss, outputs, targets, extra = inputs.loss, inputs.outputs, inputs.targets, inputs.extra
    tensor = torch.Tensor
    return (
        (loss.shape, loss.dtype, loss.device) if isinstance(loss, tensor) else type(loss),
        (outputs.shape, outputs.dtype, outputs.device) if isinstance(outputs, tensor) else type(outputs),
        (targets.shape, targets.dtype, targets.device) if isinstance(targets, tensor) else type(targets),
        tuple((k, _describe(v)) for k, v in extra.items()) if extra else (),
        _describe(inputs.grad_norm),
    )


def meta(value: object) -> object:
    """What the short path of ``step()`` compares an input with: tensor metadata, else the type."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    return type(value)


def samples_of(batch_size: int | None, outputs: object, targets: object) -> float:
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        return float(batch_size)
    for t in (outputs, targets):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return float(t.shape[0])
    return math.nan


def tensors_of(inputs: StepInputs) -> list[tuple[str, torch.Tensor]]:
    out = [(k, getattr(inputs, k)) for k in ("loss", "outputs", "targets")]
    out += [(f"extra[{k!r}]", v) for k, v in inputs.extra.items()]
    return [(k, v) for k, v in out if isinstance(v, torch.Tensor)]


def device_of(inputs: StepInputs) -> torch.device:
    tensors = tensors_of(inputs)
    for label, tensor in tensors:
        if tensor.device.type == "meta":
            raise InputError(
                f"{label} is a meta tensor (shape and dtype only, no data); expected a computed tensor; fix: "
                "pass the value computed on a real device (cpu, cuda...)"
            )
    if tensors:
        return tensors[0][1].device
    return torch.device("cpu")


def overflow_message(extra: Mapping[str, object], tokens: object) -> str:
    named = [(f"extra[{k!r}]", v) for k, v in extra.items()] + [("tokens", tokens)]
    for label, value in named:
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                float(value)
            except OverflowError:
                return (
                    f"{label} = an integer of {value.bit_length()} bits does not fit a float (at most 1024 bits, ~1.8e308); "
                    "expected a number a float can hold; fix: pass a float or a smaller number"
                )
    return "a value does not fit a float (max ~1.8e308); fix: pass floats or smaller numbers"


def check_count(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_scalar(label: str, value: object) -> None:
    """A Python number or a real 0-dim tensor (checked from metadata only)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise InputError(
                f"{label} must be a real 0-dim tensor or a number, got a tensor of shape {tuple(value.shape)} "
                f"dtype {value.dtype}; reduce it first, e.g. value.mean()"
            )
        if value.device.type == "meta":
            raise InputError(f"{label} is a meta tensor (no data); pass the computed value")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{label} must be a number or a 0-dim tensor, got {type(value).__name__}")
    try:
        float(value)
    except OverflowError:
        raise InputError(f"{label} = {value!r} does not fit a float; pass a float") from None
