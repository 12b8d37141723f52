"""The built-in metrics: loss, accuracy, learning rate, gradient norm, timings, throughput, memory."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar

import torch

from batchtap.errors import ConfigError, InputError
from batchtap.metrics import functional as F
from batchtap.metrics.base import Metric, Requirement, StepInputs, StepTiming
from batchtap.metrics.domain import ANY_FINITE, NONNEGATIVE, UNIT_INTERVAL, Domain, Output, Reduce

__all__ = [
    "Loss",
    "Accuracy",
    "LearningRate",
    "GradNorm",
    "StepTime",
    "DataTime",
    "Throughput",
    "Memory",
    "Custom",
    "Extra",
    "default_metrics",
]


def _float32(t: torch.Tensor) -> torch.Tensor:
    # No op of its own: the ring row is float32 and torch.stack(out=row) casts on the way in (exact
    # for fp16/bf16). Called under no_grad (Tap.step), so no detach is needed either.
    return t


class Loss(Metric):
    """The training loss as given to ``Tap.step(loss=...)``, recorded in float32.

    Args:
        nonnegative: the loss can never be negative (cross-entropy, MSE, ...); a negative value
            then becomes an anomaly. Pass False for losses that can go below zero (e.g. a negative
            log-likelihood of continuous data, GAN objectives).

    Example:
        >>> [o.name for o in Loss().outputs()]
        ['loss']
    """

    requires: ClassVar[frozenset[Requirement]] = frozenset({"loss"})
    device_width = 1

    def __init__(self, *, nonnegative: bool = True) -> None:
        self._domain = NONNEGATIVE if nonnegative else ANY_FINITE

    def outputs(self) -> tuple[Output, ...]:
        return (Output("loss", self._domain, Reduce.MEAN),)

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
        return (_float32(inputs.loss),)


class Accuracy(Metric):
    """Top-k classification accuracy from class scores and integer targets.

    Reports ``accuracy`` for top-1 and ``accuracy_top{k}`` for every other k, as fractions in
    [0, 1]. On the device it keeps counts of correct samples, never means, so values reduce exactly
    over ranks with uneven batches.

    Args:
        topk: the k values, e.g. ``(1, 5)``. Must contain 1.

    Example:
        >>> [o.name for o in Accuracy(topk=(1, 5)).outputs()]
        ['accuracy', 'accuracy_top5']
    """

    requires: ClassVar[frozenset[Requirement]] = frozenset({"outputs", "targets"})
    host_width = 2  # scored positions and classes: shape facts, known on the host

    def __init__(self, topk: Sequence[int] = (1,)) -> None:
        ks = tuple(sorted(set(int(k) for k in topk)))
        if not ks or ks[0] < 1 or 1 not in ks:
            raise ConfigError(f"Accuracy topk must be positive and contain 1, got {tuple(topk)}; e.g. topk=(1, 5)")
        self.topk = ks
        self.device_width = len(ks) + 2  # correct counts per k, then the smallest and largest target

    def outputs(self) -> tuple[Output, ...]:
        return tuple(
            Output("accuracy" if k == 1 else f"accuracy_top{k}", UNIT_INTERVAL, Reduce.MEAN, unit="%")
            for k in self.topk
        )

    def check(self, inputs: StepInputs) -> None:
        outputs, targets = inputs.outputs, inputs.targets
        assert outputs is not None and targets is not None
        if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise InputError(
                f"Accuracy needs tensors for outputs and targets, got {type(outputs).__name__} and "
                f"{type(targets).__name__}"
            )
        if outputs.shape[0] == 0:
            raise InputError("Accuracy got an empty batch (outputs of shape {}); skip empty batches".format(
                tuple(outputs.shape)))
        if outputs.dim() < 2 or not outputs.is_floating_point():
            raise InputError(
                f"Accuracy expects floating-point class scores of shape [N, C] (or [N, C, ...]), got "
                f"shape {tuple(outputs.shape)} dtype {outputs.dtype}; pass the model's logits"
            )
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise InputError(
                f"Accuracy expects integer class indices as targets, got dtype {targets.dtype}; "
                "for one-hot targets pass targets.argmax(1)"
            )
        expected = (outputs.shape[0], *outputs.shape[2:])
        if tuple(targets.shape) != expected:
            if targets.shape[:1] != outputs.shape[:1]:
                raise InputError(
                    f"outputs and targets disagree on batch size: {outputs.shape[0]} vs "
                    f"{targets.shape[0] if targets.dim() else 'a 0-dim tensor'}; pass the targets of the same batch"
                )
            raise InputError(
                f"targets must have shape {list(expected)} for outputs of shape {list(outputs.shape)}, "
                f"got {list(targets.shape)}"
            )
        if self.topk[-1] > outputs.shape[1]:
            raise InputError(
                f"Accuracy(topk={self.topk}) needs at least {self.topk[-1]} classes, outputs have "
                f"{outputs.shape[1]}; lower topk"
            )

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        outputs, targets = inputs.outputs, inputs.targets
        assert outputs is not None and targets is not None
        if self.topk == (1,) and outputs.dim() == 2:
            counts: Sequence[torch.Tensor] = (F.top1_correct(outputs, targets),)  # the common case, fewest ops
        else:
            counts = F.topk_correct(outputs, targets, self.topk).unbind(0)
        return (*counts, *F.target_range(targets))

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        assert inputs.targets is not None and inputs.outputs is not None
        return (float(inputs.targets.numel()), float(inputs.outputs.shape[1]))

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        positions = raw[-2]
        return [c / positions if positions else None for c in raw[: len(self.topk)]]

    def input_error(self, raw: Sequence[float]) -> str | None:
        k = len(self.topk)
        low, high, classes = raw[k], raw[k + 1], raw[-1]
        if low < 0 or high >= classes:
            return (
                f"targets hold class indices outside [0, {int(classes)}) (smallest {int(low)}, largest "
                f"{int(high)}) for outputs with {int(classes)} classes; check the labels (or the "
                "model's number of outputs)"
            )
        return None


class LearningRate(Metric):
    """The optimizer's learning rate, read on the host (it is a Python float there).

    Reports ``lr`` for the first parameter group and ``lr_group{i}`` for the others.

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> LearningRate(opt).read_host(None)
        (0.1,)
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"LearningRate needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for i, group in enumerate(optimizer.param_groups):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
                raise ConfigError(
                    f"param group {i} has a {lr.device} tensor learning rate; reading it would sync the "
                    "device every step. Use a float lr, or record it with bt.metrics.Custom"
                )
        self.optimizer = optimizer
        self.host_width = len(optimizer.param_groups)

    def outputs(self) -> tuple[Output, ...]:
        return tuple(
            Output("lr" if i == 0 else f"lr_group{i}", NONNEGATIVE, Reduce.MAX) for i in range(self.host_width)
        )

    def read_host(self, inputs: StepInputs | None) -> Sequence[float]:
        # A CPU tensor lr (allowed above) is read without any device involvement.
        return tuple(float(group["lr"]) for group in self.optimizer.param_groups[: self.host_width])


class GradNorm(Metric):
    """Global L2 norm of the gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it.

    Call ``tap.step()`` after ``backward()`` and before ``zero_grad()`` of the next step.

    Args:
        model: a module or an iterable of parameters.
    """

    device_width = 1

    def __init__(self, model: torch.nn.Module | Iterable[torch.nn.Parameter]) -> None:
        params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
        if not params:
            raise ConfigError("GradNorm got no parameters; pass the model (or its parameters)")
        self.parameters = params

    def outputs(self) -> tuple[Output, ...]:
        return (Output("grad_norm", NONNEGATIVE, Reduce.MAX),)

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        return (F.global_grad_norm(self.parameters, _step_device(inputs)),)


class StepTime(Metric):
    """Seconds of compute per step: device events on CUDA, a host clock on CPU.

    Measured from the moment the watched loader handed over the batch (or from the previous step
    when no loader is watched) to the ``Tap.step()`` call.
    """

    def outputs(self) -> tuple[Output, ...]:
        return (Output("step_time", NONNEGATIVE, Reduce.MAX, unit="s"),)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        return (None if math.isnan(timing.step_time) else timing.step_time,)


class DataTime(Metric):
    """Seconds the loop waited for the batch (host clock around the loader); needs ``tap.watch()``."""

    def outputs(self) -> tuple[Output, ...]:
        return (Output("data_time", NONNEGATIVE, Reduce.MAX, unit="s"),)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        return (None if math.isnan(timing.data_time) else timing.data_time,)


class Throughput(Metric):
    """Samples per second of step time (summed over ranks in a process group)."""

    def outputs(self) -> tuple[Output, ...]:
        return (Output("throughput", NONNEGATIVE, Reduce.SUM),)

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        if math.isnan(timing.step_time) or timing.step_time <= 0:
            return (None,)
        return (timing.samples / timing.step_time,)


class Memory(Metric):
    """CUDA memory held by tensors and its peak, in bytes, from the caching allocator's host-side
    counters (no device read). Reports nothing on other devices."""

    host_width = 2

    def outputs(self) -> tuple[Output, ...]:
        return (
            Output("memory_allocated", NONNEGATIVE, Reduce.MAX, unit="B"),
            Output("memory_peak", NONNEGATIVE, Reduce.MAX, unit="B"),
        )

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        device = _step_device(inputs)
        if device.type != "cuda":
            return (math.nan, math.nan)
        return (float(torch.cuda.memory_allocated(device)), float(torch.cuda.max_memory_allocated(device)))

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        return tuple(None if math.isnan(v) else v for v in raw)


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

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        kwargs = {key: getattr(inputs, key) for key in sorted(self.requires)}
        value = self.fn(**kwargs)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise InputError(f"custom metric {self.name!r} must return a 0-dim tensor, got {got}")
        return (_float32(value),)


class Extra(Metric):
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
            return (_float32(value),)
        device = _step_device(inputs)
        if self._missing is None or self._missing.device != device:
            self._missing = torch.full((), math.nan, dtype=torch.float32, device=device)
        return (self._missing,)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        value = inputs.extra.get(self.name)
        present = 0.0 if value is None else 1.0
        if self.on_device:
            return (present,)
        return (math.nan if value is None else float(value), present)  # type: ignore[arg-type]

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        value, present = raw
        return (value if present else None,)


def _step_device(inputs: StepInputs) -> torch.device:
    for t in (inputs.loss, inputs.outputs, inputs.targets):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def default_metrics(
    optimizer: torch.optim.Optimizer | None = None, model: torch.nn.Module | None = None
) -> list[Metric]:
    """The metric set a ``Tap`` uses when none is given.

    Loss, top-1 accuracy, step time, data wait, throughput and (on CUDA) memory; plus the learning
    rate and gradient norm when an optimizer or model is given. Metrics whose inputs a step does not
    provide (e.g. accuracy without targets) are dropped at the first step instead of failing.

    Example:
        >>> [type(m).__name__ for m in default_metrics()]
        ['Loss', 'Accuracy', 'StepTime', 'DataTime', 'Throughput', 'Memory']
    """
    metrics: list[Metric] = [Loss(), Accuracy(), StepTime(), DataTime(), Throughput(), Memory()]
    if optimizer is not None:
        metrics.insert(2, LearningRate(optimizer))
    if model is not None:
        metrics.insert(2, GradNorm(model))
    return metrics
