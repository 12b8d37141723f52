"""The values autolog takes at the optimizer step, as one metric of the autolog Tap.

Per optimizer (the first one made: ``lr``, ``grad_norm``; the others ``lr_1``, ``grad_norm_1``,
``loss_1``...): the learning rate its step used, read in the step's pre-hook; the gradient norm of
that step (the pre-clip norm of a clipping call over its parameters — ``clip_grad_norm_``'s result or
the ``total_norm`` given to ``clip_grads_with_norm_`` — else computed from the gradients the step used;
for ``DTensor`` gradients the global norm on every rank, declared ``Reduce.GLOBAL``); the loss of the ``backward()`` calls that preceded it (for the first
optimizer that is the Tap's own ``loss``). With a ``GradScaler``: the scale the step's loss was
multiplied by and whether the scaler skipped the step. The columns are fixed by :meth:`bind` at the
run's first row; a row's values are set by :meth:`set_row` right before the ``Tap.step`` call that
writes them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from batchtap.metrics.base import BlockTiming, Metric, StepInputs, StepTiming
from batchtap.metrics.domain import ANY_FINITE, NONNEGATIVE, Domain, Output, Reduce

__all__ = ["OptimizerFacts", "FactsRow", "suffix"]

_SKIP_DOMAIN = Domain(low=0.0, high=1.0)


def suffix(index: int) -> str:
    """The name suffix of the ``index``-th optimizer: ``""`` for the first, ``"_1"``... after."""
    return "" if index == 0 else f"_{index}"


@dataclasses.dataclass(slots=True)
class FactsRow:
    """One row's values. Per optimizer slot: learning rates (one per param group, or None when the
    optimizer did not step in this row), gradient norm and loss tensors (None: absent)."""

    lrs: list[tuple[float, ...] | None]
    grad_norms: list[torch.Tensor | None]
    losses: list[torch.Tensor | None]  # slot 0 unused: the Tap's Loss holds it
    scale: torch.Tensor | None = None
    skipped: torch.Tensor | float | None = None


class OptimizerFacts(Metric):
    """Learning rates, gradient norms, per-optimizer losses, loss scale and AMP skip of a row.

    Example:
        >>> facts = OptimizerFacts()
        >>> facts.bind([1, 2], scaler=True)
        >>> [o.name for o in facts.outputs()]
        ['grad_norm', 'grad_norm_1', 'loss_1', 'loss_scale', 'amp_skipped', 'lr', 'lr_1', 'lr_1_group1']
    """

    #: a step the scaler skipped has inf/NaN gradients: its norm is left out, not an anomaly
    gradient_based: ClassVar[bool] = True

    def __init__(self) -> None:
        self.groups: list[int] = []
        self.scaler = False
        self.bound = False
        self.device_width = 0
        self.host_width = 0
        self.row: FactsRow | None = None
        self._nan: torch.Tensor | None = None
        self._device_names: list[str] = []  # no columns until bind() (the Tap checks names at construction)
        self._lr_width = 0

    def bind(self, groups: Sequence[int], *, scaler: bool) -> None:
        """Fix the columns: ``groups[i]`` param groups for optimizer ``i``; whether a GradScaler steps."""
        self.groups = list(groups)
        self.scaler = scaler
        n = len(self.groups)
        self._device_names = [f"grad_norm{suffix(i)}" for i in range(n)] + [f"loss{suffix(i)}" for i in range(1, n)]
        if scaler:
            self._device_names += ["loss_scale", "amp_skipped"]
        self.device_width = len(self._device_names)
        self._lr_width = sum(self.groups)
        self.host_width = self._lr_width + self.device_width  # learning rates, then a presence flag per device value
        self.bound = True

    def set_row(self, row: FactsRow) -> None:
        self.row = row

    def outputs(self) -> tuple[Output, ...]:
        out = []
        for name in self._device_names:
            if name.startswith("grad_norm"):  # every rank's norm is over all shards already
                out.append(Output(name, NONNEGATIVE, Reduce.GLOBAL))
            elif name.startswith("loss_") and name != "loss_scale":
                out.append(Output(name, ANY_FINITE, Reduce.MEAN))
            elif name == "loss_scale":
                out.append(Output(name, NONNEGATIVE, Reduce.MAX))
            else:
                out.append(Output(name, _SKIP_DOMAIN, Reduce.MAX))
        for i, count in enumerate(self.groups):
            out += [
                Output(f"lr{suffix(i)}" if g == 0 else f"lr{suffix(i)}_group{g}", NONNEGATIVE, Reduce.GLOBAL)
                for g in range(count)
            ]
        return tuple(out)

    def _device_values(self) -> list[torch.Tensor | float | None]:
        row = self.row
        if row is None:
            return [None] * self.device_width
        values: list[torch.Tensor | float | None] = [*row.grad_norms, *row.losses[1:]]
        if self.scaler:
            values += [row.scale, row.skipped]
        return values

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        device = inputs.device or torch.device("cpu")
        out = []
        for value in self._device_values():
            if isinstance(value, torch.Tensor):
                if value.device != device:
                    value = value.to(device, non_blocking=True)
                out.append(value if value.dtype == torch.float32 else value.float())
            else:
                out.append(self._constant(math.nan if value is None else float(value), device))
        return out

    def _constant(self, value: float, device: torch.device) -> torch.Tensor:
        if math.isnan(value):
            if self._nan is None or self._nan.device != device:
                self._nan = torch.full((), math.nan, device=device)
            return self._nan
        return torch.full((), value, device=device)  # 0.0 / 1.0: a host-known skip flag (rare)

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        row = self.row
        lrs: list[float] = []
        for i, count in enumerate(self.groups):
            values = row.lrs[i] if row is not None and i < len(row.lrs) else None
            if values is None or len(values) != count:
                lrs += [math.nan] * count
            else:
                lrs += values
        present = [0.0 if v is None else 1.0 for v in self._device_values()]
        return lrs + present

    def finalize(self, raw: Sequence[float], timing: StepTiming) -> Sequence[float | None]:
        d = self.device_width
        device, lrs, present = raw[:d], raw[d : d + self._lr_width], raw[d + self._lr_width :]
        out: list[float | None] = [v if p else None for v, p in zip(device, present)]
        at = 0
        for count in self.groups:
            first = lrs[at]
            out.append(None if math.isnan(first) else first)
            out += [None if (math.isnan(v) or v == first) else v for v in lrs[at + 1 : at + count]]
            at += count
        return out

    def finalize_block(self, raw: np.ndarray, timing: BlockTiming) -> tuple[np.ndarray, np.ndarray]:
        d, w = self.device_width, self._lr_width
        values = raw[:, : d + w].copy()
        present = np.empty(values.shape, dtype=bool)
        present[:, :d] = raw[:, d + w :] != 0
        lrs = raw[:, d : d + w]
        lr_present = ~np.isnan(lrs)
        at = 0
        for count in self.groups:
            first = lrs[:, at : at + 1]
            lr_present[:, at + 1 : at + count] &= lrs[:, at + 1 : at + count] != first
            at += count
        present[:, d:] = lr_present
        return values, present

    def skipped(self, raw: Sequence[float]) -> bool:
        if not self.scaler:
            return False
        at = self.device_width - 1  # amp_skipped, the last device value
        return bool(raw[self.device_width + self._lr_width + at]) and raw[at] >= 0.5
