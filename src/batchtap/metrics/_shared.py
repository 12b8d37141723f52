"""Helpers the built-in metric families share: constant columns, presence masks, the step's device."""

from __future__ import annotations

import torch

from batchtap.metrics.base import StepInputs
from batchtap.metrics.decoding import everywhere, measured

__all__ = ["Filled", "everywhere", "measured", "step_device"]  # the numpy helpers live with the decoders


class Filled:
    """0-dim float32 tensors of fixed values, made once per value and device: a constant column
    (a placeholder, a host-known count) costs no device op per step. Holds a few at a time."""

    def __init__(self) -> None:
        self._made: dict[tuple[float, torch.device], torch.Tensor] = {}

    def __call__(self, value: float, device: torch.device) -> torch.Tensor:
        key = (value, device)  # math.nan is one object, so its key is found again
        made = self._made.get(key)
        if made is None:
            if len(self._made) >= 8:  # e.g. a count that changes with the sequence length
                self._made.clear()
            made = self._made[key] = torch.full((), value, dtype=torch.float32, device=device)
        return made


def step_device(inputs: StepInputs) -> torch.device:
    if inputs.device is not None:
        return inputs.device
    for t in (inputs.loss, inputs.outputs, inputs.targets):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")
