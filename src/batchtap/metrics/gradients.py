"""Metrics of the optimizer step's gradients: the global gradient norm and the AMP loss scale."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch

from batchtap.errors import ConfigError
from batchtap.metrics._shared import Filled, step_device
from batchtap.metrics.base import (
    Metric,
    StepInputs,
)
from batchtap.metrics.decoders import (
    _NORM_NO_GRADIENT,
    _NORM_NOT_PASSED,
    _NORM_ON_DEVICE,
    _NORM_ON_HOST,
    _SCALE_NONE,
    _SCALE_PRESENT,
    _SKIP_UNKNOWN,
    GradNormDecoding,
    LossScaleDecoding,
)
from batchtap.metrics.domain import NONNEGATIVE, Domain, Output, Reduce
from batchtap.metrics.optimizer_hooks import (
    ParameterStepListener,
    TakeAtStep,
    dtensor_type,
    global_norm,
    gradients_norm,
    scaler_states,
    scaler_stepped_since,
    step_watch,
)

# GradNorm's host state column: where this step's value is, or why there is none


class GradNorm(GradNormDecoding, Metric):
    """Global L2 norm of the gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it.

    The norm comes from the loop when it passes one — ``tap.step(grad_norm=total_norm)`` with what
    ``clip_grad_norm_`` returned, the norm *before* clipping, as a tensor (no sync) or a Python
    float — and is computed from ``model``'s gradients otherwise: float32 accumulation whatever the
    gradients' dtype, a constant number of device ops however many parameters there are. A passed
    value is taken as it is (clip after ``scaler.unscale_``, as AMP clipping must) and goes to the
    value named ``grad_norm``: a ``GradNorm`` with another ``name`` always computes its own.

    A computed norm is of the gradients the optimizer step used, wherever ``tap.step`` sits: it is
    taken on the device in the step pre-hook of any optimizer holding these parameters (the
    gradients are final there; a step given a closure, which computes them, is taken in its
    post-hook; a first step the ``scaler`` skipped, which runs no optimizer step, is told from the
    scaler's state), so ``optimizer.step(); optimizer.zero_grad(); tap.step(...)`` records this step's
    norm, not nothing. Where ``tap.step`` sits is learned at the run's first captured step: before
    any optimizer step (``tap.step`` between ``backward()`` and ``optimizer.step()``) the
    gradients are read when ``tap.step`` runs, which are the ones the coming step uses (clip
    first: a clipped gradient's norm is the clipped one). A row with no optimizer step since the
    previous one (a step the ``GradScaler`` skipped) reads the gradients as they are then; with
    none left, the value is left out and the run gets one warning saying so — never a norm of 0.

    With a ``scaler`` (``torch.amp.GradScaler``) the recorded norm is of the *unscaled* gradients:
    gradients the scaler has not unscaled yet (``tap.step`` before ``scaler.step``, or a fused
    optimizer's step, which unscales inside its kernel) are divided by the scale on the device.

    Args:
        model: a module, an iterable of parameters, or None to record only the passed
            ``grad_norm=`` (the value is left out at steps that pass none).
        name: the value's name (``grad_norm_g``... for several models).
        scaler: the AMP ``GradScaler`` whose loss scale the gradients carry.
        sharded: the plain-tensor parameters given are this rank's disjoint shard of the model's
            (a hand-written ZeRO loop): each rank's value is its local norm (computed, or what
            ``clip_grad_norm_`` of its local parameters returned) and ranks combine as the root of
            the summed squares (:attr:`~batchtap.metrics.Reduce.L2`), instead of taking the value
            every rank holds (replicated DDP gradients). ``DTensor`` parameters (FSDP2's
            ``fully_shard``, tensor parallel) need no flag: their norm is summed over the mesh on
            the device, so every rank holds the global norm
            (:attr:`~batchtap.metrics.Reduce.GLOBAL`).

    A passed ``grad_norm=`` is the global norm (``clip_grad_norm_`` of every parameter, of
    ``DTensor`` ones included: pass the ``DTensor`` as returned or its ``.full_tensor()``, the same
    value) unless ``sharded=True`` says it is this rank's local one. A global value is never
    combined across ranks again.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> model(torch.ones(2, 3)).sum().backward()
        >>> norm = GradNorm(model)
        >>> inputs = StepInputs(None, None, None, 2.0)
        >>> raw = [float(v) for v in norm.compute(inputs)] + list(norm.read_host(inputs))
        >>> reference = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
        >>> from batchtap.metrics import StepTiming
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
        self._dtensor = dtensor_type()
        dtensor = self._dtensor
        dtensors = dtensor is not None and params is not None and any(isinstance(p, dtensor) for p in params)
        # DTensor gradients give a global norm on every rank (summed over the mesh on the device):
        # declaring it sharded too would combine it again (sqrt(world) x the true norm)
        self.sharded = bool(sharded) and not dtensors
        #: whether ``tap.step(grad_norm=...)`` is this metric's value
        self.takes_step_grad_norm = name == "grad_norm"
        self._fill = Filled()
        # the norm taken at the latest optimizer step of these parameters since the last row, and
        # the id of the optimizer that took it (several optimizers of one model: taken once)
        self._taken: torch.Tensor | None = None
        self._taken_by: int | None = None
        self._after_step: bool | None = None  # tap.step follows optimizer.step (learned at the first row)
        self._scaler_states = scaler_states(scaler)  # a first step the scaler skipped shows here
        self._row_inputs: StepInputs | None = None  # the row compute() and read_host() are both about
        self._row_taken: torch.Tensor | None = None
        self._hooks: _GradNormHooks | None = _GradNormHooks(self, params) if params is not None else None

    def __getstate__(self) -> dict[str, object]:
        # pipeline="process" finalizes in another process: hooks and device values stay here
        state = self.__dict__.copy()
        state.update(_hooks=None, _taken=None, _row_inputs=None, _row_taken=None, _scaler_states=None)
        return state

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, NONNEGATIVE, Reduce.L2 if self.sharded else Reduce.GLOBAL),)

    def _passed(self, inputs: StepInputs) -> torch.Tensor | float | None:
        value = inputs.grad_norm if self.takes_step_grad_norm else None
        if isinstance(value, torch.Tensor) and self._dtensor is not None and isinstance(value, self._dtensor):
            return global_norm(value)  # clip_grad_norm_ of DTensor gradients: replicated, the global norm
        return value

    # ------------------------------------------------------------------ the optimizer step's norm

    def _take(self, optimizer: object) -> None:
        """At an optimizer step of these parameters (its hook): this step's norm, on the device."""
        if self._taken is not None and self._taken_by != id(optimizer):
            return  # a second optimizer of the same parameters in the same step: the gradients are the same
        self._taken = self._norm_now()
        self._taken_by = id(optimizer)

    def _row(self, inputs: StepInputs) -> torch.Tensor | None:
        """The norm an optimizer step took for this row (None: read the gradients now). compute()
        and read_host() both ask, in either order (the short path reads host values first): the
        first ask of a row takes the value, the second gets the same."""
        if inputs is self._row_inputs:
            self._row_inputs = None  # both asked: hold no tensor of the step longer
            return self._row_taken
        self._row_inputs = inputs
        taken, self._taken, self._taken_by = self._taken, None, None
        if self._after_step is None and self.parameters is not None:
            # a step of these parameters ran (or the scaler skipped one) before the first row:
            # tap.step follows optimizer.step
            stepped = taken is not None or scaler_stepped_since(self.scaler, self._scaler_states)
            self._after_step = stepped and self._passed(inputs) is None
            self._scaler_states = None
        self._row_taken = taken if self._after_step else None
        return self._row_taken

    def hooks_take(self) -> bool:
        """Whether the optimizer step hooks take the norm (not once ``tap.step`` proved to come first)."""
        return self._after_step is not False

    def _norm_now(self, device: torch.device | None = None) -> torch.Tensor | None:
        """The norm of the parameters' gradients as they are now (device ops only), None when none
        has one; on ``device`` (default: the first gradient's)."""
        assert self.parameters is not None
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:
            return None
        norm = gradients_norm(grads, device)
        scale = _scale_carried(self.scaler) if self.scaler is not None else None
        if scale is not None:  # still scaled: divide on the device, never read the scale
            norm = norm / (scale if scale.device == norm.device else scale.to(norm.device, non_blocking=True))
        return norm

    # ------------------------------------------------------------------ the row

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        device = inputs.device or step_device(inputs)
        value = self._passed(inputs)
        taken = self._row(inputs)
        if isinstance(value, torch.Tensor):
            return (value if value.device == device else value.to(device, non_blocking=True),)
        if value is not None or self.parameters is None:  # a Python float (host column), or nothing
            return (self._fill(math.nan, device),)
        norm = taken if taken is not None else self._norm_now(device)
        if norm is None:
            return (self._fill(math.nan, device),)
        return (norm if norm.device == device else norm.to(device, non_blocking=True),)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        value = self._passed(inputs)
        taken = self._row(inputs)
        if isinstance(value, torch.Tensor):
            return (_NORM_ON_DEVICE, math.nan)
        if value is not None:
            return (_NORM_ON_HOST, float(value))
        if self.parameters is None:
            return (_NORM_NOT_PASSED, math.nan)
        if taken is not None:
            return (_NORM_ON_DEVICE, math.nan)
        # p.grad being None is metadata; stops at the first gradient in the usual case
        if any(p.grad is not None for p in self.parameters):
            return (_NORM_ON_DEVICE, math.nan)
        if self._after_step and self.scaler is not None:
            # no optimizer step since the last row and no gradient: a step the GradScaler skipped
            # (no hook fires then) whose gradients zero_grad removed; a NaN on the device is left
            # out of a skipped row (gradient_based), an anomaly in any other
            return (_NORM_ON_DEVICE, math.nan)
        return (_NORM_NO_GRADIENT, math.nan)


class _GradNormHooks(ParameterStepListener["GradNorm"]):
    """What a :class:`GradNorm` takes at the optimizer steps of its parameters, through the shared
    step watch (which holds it weakly: it goes with its metric, and the metric may go first)."""

    __slots__ = ()

    def __init__(self, metric: GradNorm, params: Sequence[torch.Tensor]) -> None:
        super().__init__(metric, params)

    def step_begins(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        self.closure = None
        metric = self.metric()
        if metric is None or not metric.hooks_take() or not self.owns(optimizer) or torch.compiler.is_compiling():
            return
        if closure:
            self.closure = optimizer  # the closure computes this step's gradients: take the norm after it
            return
        metric._take(optimizer)

    def step_ends(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        closure_of, self.closure = self.closure, None
        metric = self.metric()
        if closure_of is optimizer and metric is not None:
            metric._take(optimizer)


class LossScale(LossScaleDecoding, Metric):
    """The AMP ``GradScaler``'s loss scale, and whether it skipped the optimizer step.

    Reports ``loss_scale`` (the scale the step's loss was multiplied by) and ``amp_skipped`` (1
    when the scaler found inf/NaN gradients and skipped ``optimizer.step``, else 0). A skipped step
    is reported as a ``skip`` event, and its non-finite gradient values
    (:attr:`~batchtap.metrics.Metric.gradient_based`) are left out instead of flagged as
    anomalies. Both values stay on the device, never read on the host.

    Both are the step's own wherever ``tap.step`` sits after the scaler's step:

    * after ``scaler.step(opt)`` (or ``scaler.unscale_(opt)``), before ``scaler.update()``: the
      scale now, and the scaler's own inf/NaN check of this step;
    * after ``scaler.update()`` (the scale then is the next step's): the scale is copied on the
      device in the optimizer's step pre-hook, and a skip is the scale dropping below it
      (``update()`` lowers it after a skip, never otherwise); a step the scaler skipped runs no
      optimizer step (no hook): its scale is the lowered one divided back by ``backoff_factor``.
      Where ``tap.step`` sits is learned at the run's first captured step (the scaler updated since
      the metric was made, or stepped); a scale lowered by hand (``update(new_scale=)``) reads as
      a skip.

    Before ``scaler.step`` (``tap.step`` right after ``backward()``) the scaler has not checked the
    gradients yet: ``loss_scale`` is the step's, ``amp_skipped`` is left out, and the run gets one
    warning saying so (the step's non-finite gradient norm is then an anomaly, not a skip).

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
        >>> from batchtap.metrics import StepTiming
        >>> metric.finalize(raw, StepTiming(1.0, 0.1, math.nan)), metric.skipped(raw)
        ([1024.0, 1.0], True)
    """

    device_width = 2  # the scale, the skip flag
    host_width = 1  # whether the scaler has a scale (_SCALE_*)

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        _check_scaler(scaler, "LossScale")
        self.scaler = scaler
        self._fill = Filled()
        # update() replaces the per-optimizer states: a new object means an update ran since the last row
        self._states: object = getattr(scaler, "_per_optimizer_states", None)
        self._placement: str | None = None  # _CHECKED / _AFTER_UPDATE / _BEFORE_STEP, learned at the first row
        self._stepped: torch.Tensor | None = None  # the scale at the latest scaler step (a device copy)
        self._hooked = False  # a scaler step ran (its hook fired) since the last row
        self._row_inputs: StepInputs | None = None
        self._row_values: tuple[tuple[torch.Tensor, ...], float] | None = None
        self._listener: TakeAtStep[LossScale] | None = TakeAtStep(self, _take_scale)
        step_watch().listen(self._listener)  # held weakly there: it goes with this metric

    def __getstate__(self) -> dict[str, object]:
        # pipeline="process" finalizes in another process: the scaler and device values stay here
        state = self.__dict__.copy()
        state.update(scaler=None, _states=None, _stepped=None, _row_inputs=None, _row_values=None, _listener=None)
        return state

    def outputs(self) -> tuple[Output, ...]:
        return (
            Output("loss_scale", NONNEGATIVE, Reduce.MAX),
            Output("amp_skipped", Domain(low=0.0, high=1.0), Reduce.MAX),
        )

    def _scale(self) -> torch.Tensor | None:
        return self.scaler._scale if self.scaler.is_enabled() else None

    def _take(self, optimizer: object) -> None:
        """In an optimizer's step pre-hook: copy the scale when the step is this scaler's."""
        if self._placement not in (None, _AFTER_UPDATE):
            return
        state = self.scaler._per_optimizer_states.get(id(optimizer))  # .get: the defaultdict adds nothing
        scale = self._scale()
        if not state or not state.get("found_inf_per_device") or scale is None:
            return  # not inside this scaler's step(): an optimizer of another loop
        if self._stepped is None or self._stepped.device != scale.device:
            self._stepped = scale.clone()
        else:
            self._stepped.copy_(scale)  # stream-ordered after the previous row's write of it
        self._hooked = True

    def _row(self, inputs: StepInputs) -> tuple[tuple[torch.Tensor, ...], float]:
        """This row's (scale, skip) device values and host marker; compute() and read_host() both
        ask, in either order: the first ask of a row decides, the second gets the same."""
        if inputs is self._row_inputs and self._row_values is not None:
            self._row_inputs = None
            return self._row_values
        self._row_inputs = inputs
        self._row_values = values = self._decide(inputs.device or step_device(inputs))
        return values

    def _decide(self, device: torch.device) -> tuple[tuple[torch.Tensor, ...], float]:
        hooked, self._hooked = self._hooked, False
        scale = self._scale()
        if scale is None:
            nan = self._fill(math.nan, device)
            return (nan, nan), _SCALE_NONE
        states = self.scaler._per_optimizer_states
        updated = states is not self._states
        self._states = states
        found = [f for state in states.values() for f in state["found_inf_per_device"].values()]
        if found:  # scaler.step/unscale_ ran and update() did not yet: the scaler's own check of this step
            if self._placement is None:
                self._placement = _CHECKED
            if len(found) == 1:
                flag = found[0]  # 0.0 or 1.0, a fresh tensor of this step: read as it is now
            else:
                flag = torch.stack([f.to(scale.device, non_blocking=True) for f in found]).amax()
            return (scale, flag), _SCALE_PRESENT
        if self._placement is None:
            self._placement = _AFTER_UPDATE if updated or hooked else _BEFORE_STEP
        if self._placement != _AFTER_UPDATE:  # the scaler has not checked this step's gradients yet
            return (scale, self._fill(math.nan, scale.device)), _SKIP_UNKNOWN
        stepped = self._stepped
        if hooked and stepped is not None:  # a step ran: a lower scale now means update() saw inf/NaN
            return (stepped, scale.lt(stepped)), _SCALE_PRESENT
        if updated:  # updated with no optimizer step: every step of the update was skipped
            backoff = float(self.scaler._backoff_factor)
            return (scale / backoff, self._fill(1.0, scale.device)), _SCALE_PRESENT
        return (scale, self._fill(0.0, scale.device)), _SCALE_PRESENT  # no scaler step since the last row

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        device = inputs.device or step_device(inputs)
        values, _ = self._row(inputs)
        return tuple(v if v.device == device else v.to(device, non_blocking=True) for v in values)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        return (self._row(inputs)[1],)


# LossScale's placements of tap.step and its host marker
_CHECKED, _AFTER_UPDATE, _BEFORE_STEP = "checked", "after-update", "before-step"


def _take_scale(metric: LossScale, optimizer: torch.optim.Optimizer) -> None:
    """At each optimizer step (the step watch's pre-hook): the scale it runs under."""
    if not torch.compiler.is_compiling():
        metric._take(optimizer)


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
