"""What autolog knows of the Hugging Face ``transformers.Trainer`` (read from its frame, never patched).

Under several processes ``Trainer.compute_loss`` multiplies the loss by the number of processes when
it passes ``num_items_in_batch`` (tokens averaged across devices, a model taking loss kwargs or a
``compute_loss_func``). From the graph alone that ``x num_processes`` looks like any constant factor
(an accumulation count), so a step of two micro-batches would be stored as their mean. The factor is
the Trainer's process factor: :func:`process_factor` names it, and the backward() hook does not count
it as a division (a BERT-like model's loss, which ignores the count, keeps the undivided sum of its
micro-batches, as ``BatchtapTrainer`` stores it; a token-normalised loss keeps the factor its global
count needs).

The Trainer's micro-batch is read from the same frame for throughput: on a causal LM,
``BatchtapTrainer`` counts the ``input_ids`` tokens of each step (tokens/s), and so does autolog
(:func:`trainer_tokens`, read when the loss function runs: ``training_step`` drops its inputs before
``backward()``), so both store the same throughput for the same script.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["process_factor", "trainer_tokens", "without_process_factor"]

#: per Trainer: whether it trains a causal LM (its model's class does not change during training)
_CAUSAL: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _training_step() -> dict[str, Any] | None:
    """The locals of the running ``Trainer.training_step`` (None outside one)."""
    module = sys.modules.get("transformers.trainer")
    path = getattr(module, "__file__", None)
    if not path:
        return None
    frame: Any = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "training_step" and code.co_filename == path:
            return frame.f_locals  # type: ignore[no-any-return]
        frame = frame.f_back
    return None


def trainer_tokens() -> int | None:
    """The ``input_ids`` tokens of the running ``training_step``'s micro-batch where the Trainer
    trains a causal LM (what ``BatchtapTrainer`` counts for throughput), else None. Shape metadata
    and host attributes only."""
    local = _training_step()
    if local is None:
        return None
    inputs, trainer = local.get("inputs"), local.get("self")
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
    if not isinstance(ids, torch.Tensor) or trainer is None:
        return None
    causal = _CAUSAL.get(trainer)
    if causal is None:
        causal = _CAUSAL[trainer] = _trains_causal_lm(trainer)
    return ids.numel() if causal else None


def _trains_causal_lm(trainer: Any) -> bool:
    """The test ``BatchtapTrainer`` makes (``integrations.transformers._is_causal_lm``): the Trainer's
    loss shifts labels, or its model's class is one of transformers' causal LMs (its auto-class
    mapping). Written here again on purpose: autolog may not import ``batchtap.integrations``, nor
    integrations a private autolog module (tests/test_architecture.py); change the two together."""
    if getattr(trainer, "_loss_shifts_labels", False):
        return True
    auto = sys.modules.get("transformers.models.auto.modeling_auto")  # loaded with the Trainer
    names = getattr(auto, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", None)
    model = getattr(trainer, "model", None)  # the Trainer keeps the unwrapped model here
    return names is not None and type(model).__name__ in set(names.values())


def process_factor() -> int:
    """The factor ``Trainer.compute_loss`` multiplied the loss of the running ``training_step`` by
    (1 outside a Trainer's ``training_step``, or where it applied none). Host attributes only."""
    local = _training_step()
    if local is None:
        return 1
    trainer: Any = local.get("self")
    count = local.get("num_items_in_batch")
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
