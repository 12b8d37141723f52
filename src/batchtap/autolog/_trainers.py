"""What autolog knows of the Hugging Face ``transformers.Trainer`` (read from its frame, never patched).

Under several processes ``Trainer.compute_loss`` multiplies the loss by the number of processes when
it passes ``num_items_in_batch`` (tokens averaged across devices, a model taking loss kwargs or a
``compute_loss_func``). From the graph alone that ``x num_processes`` looks like any constant factor
(an accumulation count), so a step of two micro-batches would be stored as their mean. The factor is
the Trainer's process factor: :func:`process_factor` names it, and the backward() hook does not count
it as a division (a BERT-like model's loss, which ignores the count, keeps the undivided sum of its
micro-batches, as ``BatchtapTrainer`` stores it; a token-normalised loss keeps the factor its global
count needs).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["process_factor"]


def process_factor() -> int:
    """The factor ``Trainer.compute_loss`` multiplied the loss of the running ``training_step`` by
    (1 outside a Trainer's ``training_step``, or where it applied none). Host attributes only."""
    module = sys.modules.get("transformers.trainer")
    path = getattr(module, "__file__", None)
    if not path:
        return 1
    frame: Any = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "training_step" and code.co_filename == path:
            break
        frame = frame.f_back
    else:
        return 1
    local = frame.f_locals
    trainer, count = local.get("self"), local.get("num_items_in_batch")
    args = getattr(trainer, "args", None)
    if count is None or not getattr(args, "average_tokens_across_devices", False):
        return 1
    if not (getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None)):
        return 1
    n_gpu = int(getattr(args, "n_gpu", 1) or 1)
    if n_gpu > 1:
        return n_gpu
    processes = int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1) or 1)
    tp_size = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
    return max(processes // int(tp_size or 1), 1)


def without_process_factor(found: Any) -> None:
    """Take the Trainer's process factor out of a resolved loss's constant factors (a ``Resolved``
    whose ``divided`` is set, not token-normalised): the factor is undone in ``found.loss`` already; it
    is no accumulation division, so two such micro-batches are undivided accumulation (their sum)."""
    factor = process_factor()
    if factor <= 1 or float(factor) not in found.factors:
        return
    kept = list(found.factors)
    kept.remove(float(factor))
    found.factors = tuple(kept)
    found.divided = bool(kept)
