"""Metrics of the optimizer step's gradients: the global gradient norm and the AMP loss scale."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from batchtap.errors import ConfigError, InputError
from batchtap.metrics import functional as F
from batchtap.metrics._shared import Filled, step_device
from batchtap.metrics.base import (
    Metric,
    StepInputs,
    StepTiming,
)
from batchtap.metrics.domain import NONNEGATIVE, Domain, Output, Reduce

# GradNorm's host state column: where this step's value is, or why there is none
_NORM_ON_DEVICE, _NORM_ON_HOST, _NORM_NOT_PASSED, _NORM_NO_GRADIENT = 1.0, 2.0, 0.0, -1.0


class GradNorm(Metric):
    """Global L2 norm of the gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it.

    The norm comes from the loop when it passes one — ``tap.step(grad_norm=total_norm)`` with what
    ``clip_grad_norm_`` returned, the norm *before* clipping, as a tensor (no sync) or a Python
    float — and is computed from ``model``'s gradients otherwise: float32 accumulation whatever the
    gradients' dtype, a constant number of device ops however many parameters there are. A passed
    value is taken as it is (clip after ``scaler.unscale_``, as AMP clipping must) and goes to the
    value named ``grad_norm``: a ``GradNorm`` with another ``name`` always computes its own.

    Call ``tap.step()`` after ``backward()`` and before ``zero_grad()``. When no parameter has a
    gradient at that point (``zero_grad(set_to_none=True)`` ran first) the value is left out and
    the run gets one warning saying so — never a norm of 0.

    With a ``scaler`` (``torch.amp.GradScaler``) the recorded norm is of the *unscaled* gradients:
    if ``scaler.unscale_(opt)`` or ``scaler.step(opt)`` ran since the last ``scaler.update()``, the
    gradients are already unscaled and taken as they are; otherwise they still carry the loss scale
    and the norm is divided by it on the device. So place ``tap.step`` after ``backward()`` and
    before ``scaler.update()`` — best after ``scaler.unscale_``/``scaler.step``, where the skip of
    :class:`LossScale` is exact too. After ``scaler.update()`` the scaler's per-step state is
    reset and nothing on the host tells unscaled gradients from scaled ones: the norm is then
    divided by the (new) scale although the gradients were unscaled; pass
    ``grad_norm=clip_grad_norm_(...)`` there instead.

    Args:
        model: a module, an iterable of parameters, or None to record only the passed
            ``grad_norm=`` (the value is left out at steps that pass none).
        name: the value's name (``grad_norm_g``... for several models).
        scaler: the AMP ``GradScaler`` whose loss scale the gradients carry.
        sharded: each rank holds a disjoint shard of the parameters (FSDP, ZeRO): each rank's value
            is its local norm and ranks combine as the root of the summed squares
            (:attr:`~batchtap.metrics.Reduce.L2`), instead of the maximum over ranks that holds
            replicated (DDP) gradients. ``None``: sharded when a parameter is a ``DTensor`` (the
            norm then uses each gradient's local shard).

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> model(torch.ones(2, 3)).sum().backward()
        >>> norm = GradNorm(model)
        >>> inputs = StepInputs(None, None, None, 2.0)
        >>> raw = [float(v) for v in norm.compute(inputs)] + list(norm.read_host(inputs))
        >>> reference = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
        >>> abs(norm.finalize(raw, StepTiming(2.0, 0.1, math.nan))[0] - reference) < 1e-6
        True
    """

    device_width = 1
    host_width = 2  # where the value is (device, host, none: why), the host value
    gradient_based: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module | Iterable[torch.nn.Parameter] | None = None,
        *,
        name: str = "grad_norm",
        scaler: torch.amp.GradScaler | None = None,
        sharded: bool | None = None,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ConfigError(f"GradNorm name must be a non-empty string, got {name!r}")
        params: list[torch.Tensor] | None = None
        if model is not None:
            params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
            if not params:
                raise ConfigError("GradNorm got no parameters; pass the model (or its parameters)")
        if scaler is not None:
            _check_scaler(scaler, "GradNorm")
        self.parameters = params
        self.name = name
        self.scaler = scaler
        self._dtensor = _dtensor_type()
        dtensor = self._dtensor
        dtensors = dtensor is not None and params is not None and any(isinstance(p, dtensor) for p in params)
        self.sharded = bool(dtensors) if sharded is None else bool(sharded)
        self._local_shards = bool(dtensors)
        #: whether ``tap.step(grad_norm=...)`` is this metric's value
        self.takes_step_grad_norm = name == "grad_norm"
        self._fill = Filled()

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, NONNEGATIVE, Reduce.L2 if self.sharded else Reduce.MAX),)

    def _passed(self, inputs: StepInputs) -> torch.Tensor | float | None:
        return inputs.grad_norm if self.takes_step_grad_norm else None

    def check(self, inputs: StepInputs) -> None:
        value = self._passed(inputs)
        if self._dtensor is not None and isinstance(value, self._dtensor):
            raise InputError(
                "grad_norm is a DTensor (clip_grad_norm_ of sharded parameters); pass "
                "grad_norm.full_tensor(), the global norm"
            )

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        device = inputs.device or step_device(inputs)
        value = self._passed(inputs)
        if isinstance(value, torch.Tensor):
            return (value if value.device == device else value.to(device, non_blocking=True),)
        if value is not None or self.parameters is None:  # a Python float (host column), or nothing
            return (self._fill(math.nan, device),)
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:
            return (self._fill(math.nan, device),)
        if self._local_shards and self._dtensor is not None:
            dtensor = self._dtensor
            grads = [_local_shard(g) if isinstance(g, dtensor) else g for g in grads]
        norm = F.grads_norm(grads, device)
        scale = _scale_carried(self.scaler) if self.scaler is not None else None
        if scale is not None:  # still scaled: divide on the device, never read the scale
            norm = norm / (scale if scale.device == device else scale.to(device, non_blocking=True))
        return (norm,)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        value = self._passed(inputs)
        if isinstance(value, torch.Tensor):
            return (_NORM_ON_DEVICE, math.nan)
        if value is not None:
            return (_NORM_ON_HOST, float(value))
        if self.parameters is None:
            return (_NORM_NOT_PASSED, math.nan)
        # p.grad being None is metadata; stops at the first gradient in the usual case
        has_grad = any(p.grad is not None for p in self.parameters)
        return (_NORM_ON_DEVICE if has_grad else _NORM_NO_GRADIENT, math.nan)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        where = raw[1]
        if where == _NORM_ON_DEVICE:
            return (raw[0],)
        if where == _NORM_ON_HOST:
            return (raw[2],)
        return (None,)

    def warning(self, raw: Sequence[float]) -> str | None:
        if raw[1] != _NORM_NO_GRADIENT:
            return None
        return (
            f"{self.name}: no parameter had a gradient when tap.step() ran (zero_grad(set_to_none=True) "
            "before tap.step?); call tap.step after backward() and before zero_grad(), or pass "
            "tap.step(grad_norm=clip_grad_norm_(...))"
        )


class LossScale(Metric):
    """The AMP ``GradScaler``'s loss scale, and whether it skipped the optimizer step.

    Reports ``loss_scale`` and ``amp_skipped`` (1 when the scaler found inf/NaN gradients and
    skipped ``optimizer.step``, else 0). A skipped step is reported as a ``skip`` event, and its
    non-finite gradient values (:attr:`~batchtap.metrics.Metric.gradient_based`) are left out
    instead of flagged as anomalies. Both values are read on the device, never on the host.

    Where ``tap.step`` sits decides how the skip is known:

    * after ``scaler.step(opt)`` (or ``scaler.unscale_(opt)``), before ``scaler.update()`` — the
      recommended place: the skip is the scaler's own inf/NaN check of this step, and
      ``loss_scale`` is the scale this step's loss was multiplied by;
    * after ``scaler.update()``: the scaler has forgotten its check; a skip shows as the scale
      dropping below the previous step's (nothing is known at the run's first step, and a scale
      lowered by hand with ``update(new_scale=)`` reads as a skip); ``loss_scale`` is the scale
      for the next step;
    * before ``scaler.step`` (right after ``backward()``): the drop is seen one step late, so a
      skip is marked on the step after the skipped one.

    A scaler that is disabled (``enabled=False``) or has not scaled a loss yet gives no values.

    Args:
        scaler: a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` too).

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
        >>> scaler.scale((w * float("inf")).sum()).backward()  # inf gradients
        >>> scaler.step(opt)
        >>> metric = LossScale(scaler)
        >>> inputs = StepInputs(None, None, None, 1.0)
        >>> raw = [float(v) for v in metric.compute(inputs)] + list(metric.read_host(inputs))
        >>> metric.finalize(raw, StepTiming(1.0, 0.1, math.nan)), metric.skipped(raw)
        ([1024.0, 1.0], True)
    """

    device_width = 2  # the scale, the skip flag
    host_width = 1  # whether the scaler has a scale

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        _check_scaler(scaler, "LossScale")
        self.scaler = scaler
        self._previous: torch.Tensor | None = None  # the scale at the last step (device copy)
        self._fill = Filled()

    def outputs(self) -> tuple[Output, ...]:
        return (
            Output("loss_scale", NONNEGATIVE, Reduce.MAX),
            Output("amp_skipped", Domain(low=0.0, high=1.0), Reduce.MAX),
        )

    def _scale(self) -> torch.Tensor | None:
        return self.scaler._scale if self.scaler.is_enabled() else None

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        device = inputs.device or step_device(inputs)
        scale = self._scale()
        if scale is None:
            self._previous = None
            nan = self._fill(math.nan, device)
            return (nan, nan)
        if scale.device != device:
            scale = scale.to(device, non_blocking=True)
        found = [
            f for state in self.scaler._per_optimizer_states.values() for f in state["found_inf_per_device"].values()
        ]
        if found:  # scaler.step/unscale_ ran and update() did not yet: the scaler's own check
            self._previous = None  # (the scale-drop comparison is not used at this placement)
            if len(found) == 1 and found[0].device == device:
                flag = found[0]  # 0.0 or 1.0, a fresh tensor of this step: read as it is now
            else:
                flag = torch.stack([f.to(device, non_blocking=True) for f in found]).amax()
            return (scale, flag)
        # update() ran (or nothing did yet): a skip lowered the scale below the previous step's
        previous = self._previous
        if previous is None or previous.device != scale.device:
            self._previous = scale.clone()
            return (scale, self._fill(0.0, device))
        flag = scale.lt(previous)
        previous.copy_(scale)  # after the comparison, in stream order
        return (scale, flag)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        return (0.0 if self._scale() is None else 1.0,)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        scale, skipped, present = raw
        if not present:
            return [None, None]
        return [scale, skipped]

    def skipped(self, raw: Sequence[float]) -> bool:
        return bool(raw[2]) and raw[1] >= 0.5


def _check_scaler(scaler: object, who: str) -> None:
    if not callable(getattr(scaler, "is_enabled", None)) or not callable(getattr(scaler, "update", None)):
        raise ConfigError(
            f"{who} needs a torch.amp.GradScaler, got {type(scaler).__name__}; pass the scaler whose "
            "scale(loss).backward() the loop calls"
        )


def _scale_carried(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scale the gradients still carry (a device tensor, not read), or None when they carry
    none: scaler disabled, nothing scaled yet, or ``unscale_``/``step`` already ran since the last
    ``update()`` (its per-optimizer stages are host-side Python state)."""
    if not scaler.is_enabled() or scaler._scale is None:
        return None
    for state in scaler._per_optimizer_states.values():
        if getattr(state.get("stage"), "name", None) in ("UNSCALED", "STEPPED"):
            return None
    return scaler._scale


def _local_shard(grad: Any) -> torch.Tensor:
    local: torch.Tensor = grad.to_local()  # a DTensor's own shard: no communication
    return local


def _dtensor_type() -> type | None:
    """``DTensor`` when its module is loaded (a model with DTensor parameters loaded it), else None:
    nothing is imported here, so plain runs never pay for ``torch.distributed.tensor``."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        found = getattr(sys.modules.get(module), "DTensor", None)
        if isinstance(found, type):
            return found
    return None
