"""The tests' Lightning ``Trainer``: on the CPU, one device, and quiet (no logger, progress bar,
model summary or checkpoints), so a test's output and files are its own."""

from __future__ import annotations

from typing import Any


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
