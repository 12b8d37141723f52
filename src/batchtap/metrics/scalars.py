"""Scalar metrics taken as given: the loss, the learning rate, device memory, a user's custom function
and ``extra=`` values."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from batchtap.errors import ConfigError, InputError
from batchtap.metrics._shared import Filled, step_device
from batchtap.metrics.base import (
    Combine,
    Metric,
    MicroWriter,
    Requirement,
    RowWriter,
    StepInputs,
)
from batchtap.metrics.decoders import ExtraDecoding, LearningRateDecoding, LossDecoding, MemoryDecoding
from batchtap.metrics.domain import ANY_FINITE, NONNEGATIVE, Domain, Output, Reduce
from batchtap.metrics.optimizer_hooks import TakeAtStep, scaler_states, scaler_stepped_since, step_watch


class Loss(LossDecoding, Metric):
    """The training loss as given to ``Tap.step(loss=...)``, recorded in float32.

    Args:
        nonnegative: the loss can never be negative (cross-entropy, MSE, ...); a negative value
            then becomes an anomaly. Pass False for losses that can go below zero (e.g. a negative
            log-likelihood of continuous data, GAN objectives).

    Example:
        >>> [o.name for o in Loss().outputs()]
        ['loss']
    """

    watched_by_nan_guard: ClassVar[bool] = True
    requires: ClassVar[frozenset[Requirement]] = frozenset({"loss"})
    device_width = 1

    def __init__(self, *, nonnegative: bool = True) -> None:
        self._domain = NONNEGATIVE if nonnegative else ANY_FINITE

    def outputs(self) -> tuple[Output, ...]:
        return (Output("loss", self._domain, Reduce.MEAN, higher_is_better=False),)

    def combine(self) -> tuple[Combine, ...]:
        return (Combine.MEAN,)  # sample-weighted over the micro-batches of an optimizer step

    def check(self, inputs: StepInputs) -> None:
        loss = inputs.loss
        if not isinstance(loss, torch.Tensor):
            raise InputError(
                f"loss must be a 0-dim floating-point tensor, got {type(loss).__name__}; pass the loss "
                "tensor itself (loss.item() or float(loss) already forced a device sync)"
            )
        if loss.dim() != 0:
            raise InputError(
                f"loss must be a 0-dim tensor, got shape {tuple(loss.shape)}; reduce it first, "
                "e.g. loss.mean(), or build the criterion with reduction='mean'"
            )
        if not loss.is_floating_point():
            raise InputError(
                f"loss must be a floating-point tensor, got dtype {loss.dtype}; "
                "pass the criterion's floating-point output"
            )

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        assert inputs.loss is not None
        return ((inputs.loss),)

    def row_writer(self, example: StepInputs, columns: torch.Tensor) -> RowWriter:
        cells = [columns.select(0, slot).select(0, 0) for slot in range(columns.shape[0])]

        def write(inputs: StepInputs, slot: int, fresh: bool) -> None:
            # fill_ from a 0-dim tensor of the same device: a device-side copy, cast to float32
            cells[slot].fill_(inputs.loss)  # type: ignore[arg-type]  # the short path checked it

        return write

    def micro_writer(self, example: StepInputs, capacity: int) -> MicroWriter | None:
        assert example.loss is not None
        return _LossSum(capacity, example.loss.device)


class _LossSum(MicroWriter):
    """Each micro-batch's loss times its samples into its own float32 cell (one op: the general
    path's stack and multiply in one), the cells summed when the step closes."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self._device = device
        cells = torch.zeros(capacity, dtype=torch.float32, device=device)
        self._cells = [cells.select(0, i) for i in range(capacity)]  # views made once
        self._firsts = [cells.narrow(0, 0, n) for n in range(capacity + 1)]  # ... by count
        self._weights = Filled()  # float32 weights on the device: made once each, never uploaded

    def write(self, inputs: StepInputs, index: int) -> None:
        samples = inputs.batch_size
        weight = self._weights(samples if math.isfinite(samples) else 1.0, self._device)
        # float32 x float32 0-dim: computed in float32 whatever the loss's dtype
        torch.mul(inputs.loss, weight, out=self._cells[index])  # type: ignore[arg-type]  # checked

    def settle(self, count: int) -> Sequence[torch.Tensor]:
        return (self._firsts[count].sum(),)


class LearningRate(LearningRateDecoding, Metric):
    """The learning rate the optimizer step used, read on the host (it is a Python float there).

    The value is taken at the optimizer's step pre-hook (the shared step watch), so it is
    the step's own wherever the loop calls ``scheduler.step()`` or sets ``group["lr"]``: the common
    ``optimizer.step(); scheduler.step(); tap.step(...)`` records this step's lr, not the next
    one's. Where ``tap.step`` sits is learned at the run's first captured step: after an optimizer
    step (the usual loop) each row gets the lr of the latest step since the previous row; before
    any (``tap.step`` between ``backward()`` and ``optimizer.step()``) the param groups are read
    as they are then, which is what the coming step uses. A step the AMP ``GradScaler`` skipped
    runs no optimizer step (no hook): its row gets the lr the step would have used, known from
    where the loop moves the lr — between the optimizer step and ``tap.step`` (the scheduler
    before ``tap.step``: the lr read at the previous row) or elsewhere (read now), learned from
    the steps before. Where that is not known yet and the two differ, the lr is left out of that
    row and the run gets one warning saying so.

    Reports ``name`` for the first parameter group and ``{name}_group{i}`` for the others, one
    value per param group where groups differ: a group's value is recorded only at steps where it
    differs from group 0's (the common case of equal groups stores one value).

    Args:
        optimizer: the optimizer whose ``param_groups`` are read.
        name: the value's name, e.g. ``"lr_g"`` for a GAN's generator.
        scaler: the AMP ``GradScaler`` of the loop, if any (``bt.Tap(scaler=)`` passes it): a run's
            first step that the scaler skipped runs no optimizer step, and only the scaler tells
            that ``tap.step`` comes after the step rather than before it.

    Example:
        >>> w, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        >>> opt = torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.01}], lr=0.1)
        >>> lr = LearningRate(opt)
        >>> [o.name for o in lr.outputs()], lr.read_host(None)
        (['lr', 'lr_group1'], (0.1, 0.01))
        >>> from batchtap.metrics import StepTiming
        >>> lr.finalize([0.1, 0.1], StepTiming(1.0, 0.1, math.nan))  # equal groups: one value
        [0.1, None]
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, name: str = "lr", scaler: Any = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"LearningRate needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not name or not isinstance(name, str):
            raise ConfigError(f"LearningRate name must be a non-empty string, got {name!r}")
        for i, group in enumerate(optimizer.param_groups):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
                raise ConfigError(
                    f"param group {i} has a {lr.device} tensor learning rate; reading it would sync the "
                    "device every step. Use a float lr, or record it with bt.metrics.Custom"
                )
        self.optimizer = optimizer
        self.name = name
        self.host_width = len(optimizer.param_groups)
        self._taken: tuple[float, ...] | None = None  # the lr of the latest step not yet recorded
        self._after_step: bool | None = None  # tap.step follows optimizer.step (learned at the first read)
        self.scaler = scaler
        self._scaler_states = scaler_states(scaler)  # a first step the scaler skipped shows here
        # the lr moves between an optimizer step and its tap.step (the scheduler steps before tap.step),
        # learned from rows whose step ran; with the lrs of the previous row (for a skipped step's row)
        self._moves: bool | None = None
        self._previous_taken: tuple[float, ...] | None = None
        self._previous_now: tuple[float, ...] | None = self.current()  # the lr when the metric was made
        self._handle: TakeAtStep[LearningRate] | None = TakeAtStep(self, _take_learning_rate)
        step_watch().listen(self._handle)  # held weakly there: it goes with this metric

    def __getstate__(self) -> dict[str, object]:
        # pipeline="process" finalizes in another process: the hook stays with the optimizer here
        state = self.__dict__.copy()
        state["_handle"] = None
        state["scaler"] = state["_scaler_states"] = None
        return state

    def outputs(self) -> tuple[Output, ...]:
        return tuple(
            Output(self.name if i == 0 else f"{self.name}_group{i}", NONNEGATIVE, Reduce.MAX)
            for i in range(self.host_width)
        )

    def read_host(self, inputs: StepInputs | None) -> Sequence[float]:
        taken, self._taken = self._taken, None
        if self._after_step is None and inputs is not None:
            self._after_step = taken is not None or scaler_stepped_since(self.scaler, self._scaler_states)
            self._scaler_states = None
        now = self.current()
        if not self._after_step:
            return now
        previous_taken, previous_now = self._previous_taken, self._previous_now
        self._previous_now = now
        if taken is not None:
            if now != taken:
                self._moves = True  # moved between the step and this row: the scheduler runs before tap.step
            elif previous_taken is not None and taken != previous_taken:
                self._moves = False  # moved since the last step, but not before this row
            self._previous_taken = taken
            return taken
        # no optimizer step since the previous row (a step the GradScaler skipped): the lr it would have used
        if self._moves is True and previous_now is not None:
            return previous_now  # set before the previous row, unchanged until this step
        if self._moves is False or previous_now is None or previous_now == now:
            return now
        return (math.nan,) * self.host_width  # not known which: left out, said once (warning)

    def current(self) -> tuple[float, ...]:
        """The param groups' learning rates now (a CPU tensor lr is read without device involvement)."""
        return tuple(float(group["lr"]) for group in self.optimizer.param_groups[: self.host_width])


def _take_learning_rate(metric: LearningRate, optimizer: torch.optim.Optimizer) -> None:
    """At each optimizer step (the step watch's pre-hook): the lrs the step uses, for its own optimizer."""
    if optimizer is metric.optimizer:
        metric._taken = metric.current()


class Memory(MemoryDecoding, Metric):
    """CUDA memory held by tensors and its peak, in bytes, from the caching allocator's host-side
    counters (no device read). Reports nothing on other devices.

    One allocator-stats lookup per step (``torch.cuda.memory_stats_as_nested_dict``; the
    ``memory_allocated`` / ``max_memory_allocated`` pair would build and flatten the whole stats
    dict twice). ``memory_peak`` is the peak since the previous flush: the Tap resets the
    allocator's peak counter at each flush, so a spike shows in the rows around it rather than in
    every later row. Pass ``peak="process"`` to keep the allocator's peak since process start (and
    leave ``torch.cuda.max_memory_allocated`` to a loop that reads it itself).
    """

    host_width = 2

    def __init__(self, *, peak: str = "interval") -> None:
        if peak not in ("interval", "process"):
            raise ConfigError(f"Memory peak must be 'interval' or 'process', got {peak!r}")
        self.peak = peak
        self._device: torch.device | None = None  # the CUDA device of the steps, once seen

    def outputs(self) -> tuple[Output, ...]:
        return (
            Output("memory_allocated", NONNEGATIVE, Reduce.MAX, unit="B"),
            Output("memory_peak", NONNEGATIVE, Reduce.MAX, unit="B"),
        )

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        device = step_device(inputs)
        if device.type != "cuda":
            return (math.nan, math.nan)
        self._device = device
        stats = torch.cuda.memory_stats_as_nested_dict(device)  # empty before CUDA is initialised
        allocated = stats.get("allocated_bytes", {}).get("all", {})
        return (float(allocated.get("current", math.nan)), float(allocated.get("peak", math.nan)))

    def on_flush(self) -> None:
        if self.peak == "interval" and self._device is not None and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(self._device)  # host-side counters: no device sync


class Custom(Metric):
    """A user-defined metric: a pure tensor function of the step's tensors.

    Args:
        name: value name in records.
        fn: called with the required tensors as keyword arguments (``loss=``, ``outputs=``,
            ``targets=``); returns a 0-dim tensor. It must not read values on the host.
        requires: which of ``"loss"``, ``"outputs"``, ``"targets"`` ``fn`` takes.
        domain: legal values; others become NaN plus an anomaly event.
        reduce: how values combine across ranks.

    Example:
        >>> mae = Custom("mae", lambda outputs, targets: (outputs - targets).abs().mean(),
        ...              requires=("outputs", "targets"), domain=Domain(low=0.0))
        >>> [o.name for o in mae.outputs()]
        ['mae']
    """

    device_width = 1

    def __init__(
        self,
        name: str,
        fn: Callable[..., torch.Tensor],
        *,
        requires: Sequence[Requirement] = ("outputs", "targets"),
        domain: Domain = ANY_FINITE,
        reduce: Reduce = Reduce.MEAN,
    ) -> None:
        unknown = set(requires) - {"loss", "outputs", "targets"}
        if unknown:
            raise ConfigError(f"Custom requires must name loss/outputs/targets, got {sorted(unknown)}")
        if not name or not isinstance(name, str):
            raise ConfigError(f"Custom metric name must be a non-empty string, got {name!r}")
        self.name, self.fn, self.domain, self.reduce = name, fn, domain, Reduce(reduce)
        self.requires = frozenset(requires)  # type: ignore[misc]  # per-instance override

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, self.domain, self.reduce),)

    def combine(self) -> tuple[Combine, ...]:
        # over micro-batches as over ranks; a norm (L2) has no micro-batch form: a weighted mean
        return (_COMBINE_OF_REDUCE.get(self.reduce, Combine.MEAN),)

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        kwargs = {key: getattr(inputs, key) for key in sorted(self.requires)}
        value = self.fn(**kwargs)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(f"custom metric {self.name!r} must return a 0-dim tensor, got {got}")
        return ((value),)


_COMBINE_OF_REDUCE = {
    Reduce.MEAN: Combine.MEAN,
    Reduce.SUM: Combine.SUM,
    Reduce.MAX: Combine.MAX,
    Reduce.MIN: Combine.MIN,
}


class Extra(ExtraDecoding, Metric):
    """A value passed as ``tap.step(extra={name: value})``: a device tensor or a Python number.

    The kind (tensor or number) is fixed at the value's first appearance. A step that does not pass
    the value leaves it out of its record (a host-side presence column says which steps did).
    """

    def __init__(self, name: str, *, on_device: bool) -> None:
        self.name = name
        self.on_device = on_device
        # device value + presence flag, or host value + presence flag
        self.device_width, self.host_width = (1, 1) if on_device else (0, 2)
        self._missing: torch.Tensor | None = None  # NaN placeholder, made once per device

    def outputs(self) -> tuple[Output, ...]:
        return (Output(self.name, ANY_FINITE, Reduce.MEAN),)

    def check(self, inputs: StepInputs) -> None:
        value = inputs.extra.get(self.name)
        if value is None:
            return
        if isinstance(value, torch.Tensor):
            if not self.on_device:
                raise InputError(
                    f"extra {self.name!r} arrived as a tensor but was a Python number at its first step; "
                    "pass the same kind every step"
                )
            if value.dim() != 0 or value.is_complex():
                raise InputError(
                    f"extra {self.name!r} must be a real 0-dim tensor, got shape {tuple(value.shape)} "
                    f"dtype {value.dtype}; reduce it first, e.g. value.mean()"
                )
        elif self.on_device:
            raise InputError(
                f"extra {self.name!r} arrived as {type(value).__name__} but was a tensor at its first step; "
                "pass the same kind every step"
            )
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise InputError(f"extra {self.name!r} must be a 0-dim tensor or a number, got {type(value).__name__}")

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        if not self.on_device:
            return ()
        value = inputs.extra.get(self.name)
        if isinstance(value, torch.Tensor):
            return ((value),)
        device = step_device(inputs)
        if self._missing is None or self._missing.device != device:
            self._missing = torch.full((), math.nan, dtype=torch.float32, device=device)
        return (self._missing,)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        value = inputs.extra.get(self.name)
        present = 0.0 if value is None else 1.0
        if self.on_device:
            return (present,)
        return (math.nan if value is None else float(value), present)  # type: ignore[arg-type]
