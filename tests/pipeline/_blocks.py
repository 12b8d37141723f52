"""Blocks built directly from :class:`BlockData` for the pipeline's seam tests (no ring, no Tap)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from batchtap.capture.flush import BlockData
from batchtap.metrics import Loss, StepTime
from batchtap.metrics.base import Metric
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain.messages import BlockRows, OpenChain


def metrics() -> tuple[Metric, ...]:
    return (Loss(), StepTime())


def loss_block(losses: Sequence[float], *, first_step: int = 0) -> BlockData:
    """A block of the metrics above: one loss per row (device), the step time from the clock."""
    n = len(losses)
    layout = Layout(list(metrics()))
    device = np.zeros((n, layout.device_width))
    device[:, 0] = losses
    return BlockData(
        device_values=device,
        host_values=np.zeros((n, layout.host_width)),
        step=np.arange(first_step, first_step + n),
        epoch=np.zeros(n, dtype=np.int64),
        batch=np.arange(n),
        wall_time=np.linspace(1.0, 2.0, n),
        samples=np.full(n, 8.0),
        data_time=np.full(n, math.nan),
        tokens=np.full(n, math.nan),
        step_time=np.full(n, 0.01),
    )


def opening(chain: int, run_id: str = "r", *, writes: bool = True) -> OpenChain:
    return OpenChain(chain, Layout(list(metrics())).columns, run_id, 0, writes)


def rows(chain: int, losses: Sequence[float], *, first_step: int = 0) -> BlockRows:
    return BlockRows(chain, loss_block(losses, first_step=first_step))
