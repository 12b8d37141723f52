"""The metric set a ``Tap`` uses when none is given."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from batchtap.metrics.accuracy import Accuracy
from batchtap.metrics.base import (
    Metric,
)
from batchtap.metrics.gradients import GradNorm, LossScale
from batchtap.metrics.scalars import LearningRate, Loss, Memory
from batchtap.metrics.system import System, nvml_available
from batchtap.metrics.timing import DataTime, StepTime, Throughput


def default_metrics(
    optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None = None,
    model: torch.nn.Module | Mapping[str, torch.nn.Module] | None = None,
    *,
    scaler: torch.amp.GradScaler | None = None,
) -> list[Metric]:
    """The metric set a ``Tap`` uses when none is given.

    Loss, top-1 accuracy, step time, data wait, throughput, (on CUDA) memory and, where NVML sees a
    GPU, :class:`~batchtap.metrics.System` (GPU utilisation, power, ..., CPU and RAM); plus the learning
    rate and gradient norm when an optimizer or model is given, and the AMP loss scale with a
    ``scaler`` (which also makes the gradient norm unscaled). Metrics that do not fit a step's
    inputs (accuracy without targets, or of floating-point targets) are dropped at the first step
    instead of failing.

    Args:
        optimizer: an optimizer (value ``lr``), or a mapping name -> optimizer, e.g.
            ``{"g": opt_g, "d": opt_d}`` (values ``lr_g``, ``lr_d``).
        model: a module (value ``grad_norm``), or a mapping name -> module (``grad_norm_g``...).
        scaler: an AMP ``GradScaler``: adds :class:`LossScale`.

    Example:
        >>> [type(m).__name__ for m in default_metrics()][:6]
        ['Loss', 'Accuracy', 'StepTime', 'DataTime', 'Throughput', 'Memory']
        >>> g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
        >>> opts = {"g": torch.optim.SGD(g.parameters(), lr=0.1), "d": torch.optim.SGD(d.parameters(), lr=0.2)}
        >>> [o.name for m in default_metrics(opts, {"g": g, "d": d}) for o in m.outputs()][:6]
        ['loss', 'accuracy', 'grad_norm_g', 'grad_norm_d', 'lr_g', 'lr_d']
    """
    metrics: list[Metric] = [Loss(), Accuracy()]
    if model is not None:
        if isinstance(model, Mapping):
            metrics += [GradNorm(m, name=f"grad_norm_{key}", scaler=scaler) for key, m in model.items()]
        else:
            metrics.append(GradNorm(model, scaler=scaler))
    if scaler is not None:
        metrics.append(LossScale(scaler))
    if optimizer is not None:
        if isinstance(optimizer, Mapping):
            metrics += [LearningRate(opt, name=f"lr_{key}", scaler=scaler) for key, opt in optimizer.items()]
        else:
            metrics.append(LearningRate(optimizer, scaler=scaler))
    metrics += [StepTime(), DataTime(), Throughput(), Memory()]
    if nvml_available():  # GPU utilisation and host load, sampled off the training thread
        metrics.append(System())
    return metrics
