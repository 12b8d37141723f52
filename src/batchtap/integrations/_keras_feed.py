"""The one hand-over from a TensorFlow ring snapshot to batchtap's pipeline.

TensorFlow rows are written on the device inside the compiled step (``_tf_ring.py``) and read on
the host once per flush. This module turns such a snapshot into ``Tap.step()`` calls, so the rows
go through the same pipeline as every PyTorch step: validation, the NaN guard, rules, rank
reduction and sinks. Nothing else in the TensorFlow adapters talks to the Tap's step path: when
the capture/pipeline hand-over gains a block-level entry point, :func:`feed_rows` is the one
place to re-point. It imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from batchtap.tap import Tap

__all__ = ["HostBlock", "feed_rows"]


@dataclasses.dataclass
class HostBlock:
    """Rows read back from a device ring, in step order, as host arrays (float64).

    Attributes:
        loss: the step's loss, one per row.
        samples: samples in the step's batch.
        epoch: the epoch of each row.
        batch: the batch index within its epoch.
        values: every other value by name (``accuracy``, ``grad_norm``, ``lr``, ``step_time``,
            your extras...); NaN where a row has no value (the name is then left out of that row).
    """

    loss: np.ndarray
    samples: np.ndarray
    epoch: np.ndarray
    batch: np.ndarray
    values: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.loss)


def feed_rows(tap: Tap, block: HostBlock) -> int:
    """Hand every row of ``block`` to ``tap``'s pipeline; returns how many it took.

    Stops early (and returns fewer) once the Tap asks to stop: rows after a NaN stop are not
    recorded, as a PyTorch loop that breaks on ``tap.should_stop`` records none either.
    Host arrays only: nothing here reads a device value.
    """
    losses = torch.from_numpy(np.ascontiguousarray(block.loss, dtype=np.float32))
    grad_norm = block.values.get("grad_norm")
    extras = {name: column for name, column in block.values.items() if name != "grad_norm"}
    for i in range(len(block)):
        extra = {name: float(column[i]) for name, column in extras.items() if not math.isnan(column[i])}
        norm = None if grad_norm is None or math.isnan(grad_norm[i]) else float(grad_norm[i])
        tap.step(
            loss=losses[i],
            extra=extra,
            grad_norm=norm,
            batch_size=int(block.samples[i]),
            epoch=int(block.epoch[i]),
            batch=int(block.batch[i]),
        )
        if tap.should_stop:
            return i + 1
    return len(block)


def split_calls(durations: Sequence[tuple[float, int]], rows: int) -> np.ndarray:
    """Per-row step time from host clocks around compiled calls: each call's seconds spread evenly
    over the steps it ran (``steps_per_execution`` each; the last call takes what rows remain).

    Example:
        >>> split_calls([(0.2, 2), (0.3, 2)], 3).tolist()
        [0.1, 0.1, 0.3]
    """
    out = np.full(rows, np.nan)
    start = 0
    for index, (seconds, planned) in enumerate(durations):
        if start >= rows:
            break
        count = rows - start if index == len(durations) - 1 else min(planned, rows - start)
        if count > 0:
            out[start : start + count] = seconds / count
        start += count
    return out
