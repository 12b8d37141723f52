"""The tests' Lightning ``Trainer``: on the CPU, one device, and quiet (no logger, progress bar,
model summary or checkpoints), so a test's output and files are its own; and the slow stream the
data-time tests feed it (a loader without a length, which Lightning's fetcher reads one batch ahead)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

BATCH, SLOW_BATCH = 4, 0.3  # samples per batch, seconds a slow batch takes to fetch


def sample(i: int) -> tuple[torch.Tensor, int]:
    """Sample ``i`` of the streams: 8 features, one of 4 classes (the same at every call)."""
    return torch.randn(8, generator=torch.Generator().manual_seed(i)), i % 4


class SlowStream(IterableDataset):  # type: ignore[type-arg]
    """``batches`` batches of :data:`BATCH` samples without a length; those whose index is in ``slow``
    take :data:`SLOW_BATCH` seconds to fetch."""

    def __init__(self, batches: int, slow: set[int]) -> None:
        self.batches, self.slow = batches, slow

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        for i in range(self.batches * BATCH):
            if i // BATCH in self.slow:
                time.sleep(SLOW_BATCH / BATCH)
            yield sample(i)


def quiet_trainer(**settings: Any) -> Any:
    """``lightning.pytorch.Trainer`` with the quiet defaults; ``settings`` add to them or override them."""
    import lightning.pytorch as pl

    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**quiet, **settings})
