"""Keras on the PyTorch backend: each training step goes straight to ``tap.step()``.

The step's tensors are torch tensors on the training device, so batchtap's own metrics and
pipeline run unchanged: the loss ``compute_loss`` returned (sample-weighted as Keras weights it),
accuracy from ``y_pred`` and the targets (class indices, or one-hot rows turned into indices on the
device), the gradient norm (unscaled under a ``LossScaleOptimizer``) and the learning rate the
step used (schedules included), taken before ``apply`` advances the iteration count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchtap.integrations._keras_hooks import Hooks, optimizer_facts
from batchtap.tap import Tap

__all__ = ["TorchRecorder", "class_targets"]


def class_targets(y: Any, y_pred: Any) -> torch.Tensor | None:
    """Targets as class indices for ``y_pred`` of shape ``[..., C]`` (C > 1), or None where top-1
    accuracy does not apply (one score per sample, no targets). Metadata only, device ops only."""
    if not isinstance(y, torch.Tensor) or not isinstance(y_pred, torch.Tensor) or y_pred.dim() < 2:
        return None
    classes = y_pred.shape[-1]
    if classes < 2:
        return None
    if y.shape == y_pred.shape:
        return y.argmax(-1)  # one-hot (categorical) targets
    if y.dim() == y_pred.dim() and y.shape[-1] == 1:
        y = y.squeeze(-1)
    if y.shape != y_pred.shape[:-1]:
        return None
    return y if not (y.is_floating_point() or y.dtype == torch.bool) else y.long()


class TorchRecorder:
    """Hooks a Keras model on the torch backend and calls ``tap.step`` once per training step."""

    def __init__(self, model: Any, tap: Tap, position: Callable[[], tuple[int, int]]) -> None:
        self.model = model
        self.tap = tap
        self.position = position  # (epoch, batch) of the step being recorded
        self._holder, self._scale = optimizer_facts(model.optimizer)
        self.no_loss = False  # a train_step applied gradients without compute_loss: nothing recorded
        self.hooks = Hooks(model, self._on_apply)

    def remove(self) -> None:
        self.hooks.remove()

    def _on_apply(self, grads: Any, variables: Any, apply: Callable[..., Any]) -> Any:
        lr = self._lr()  # before apply: the rate this step uses, not the next one's
        result = apply(grads, variables)
        self._record(grads, lr)
        return result

    @torch.compiler.disable  # type: ignore[misc]  # host bookkeeping: never traced into a compiled step
    def _lr(self) -> torch.Tensor | None:
        value = getattr(self._holder, "learning_rate", None)
        value = getattr(value, "value", value)  # a Keras Variable holds a torch tensor
        if isinstance(value, torch.Tensor):
            # a copy on the device: a constant rate is a variable a callback may assign later
            return value.detach().to(torch.float32).clone()
        if isinstance(value, (int, float)):
            return torch.tensor(float(value))
        return None

    @torch.compiler.disable  # type: ignore[misc]
    def _record(self, grads: Any, lr: torch.Tensor | None) -> None:
        seen, self.hooks.seen = self.hooks.seen, None
        if seen is None or not isinstance(seen.loss, torch.Tensor):
            self.no_loss = True  # a custom train_step without compute_loss: said once, nothing recorded
            return
        tensors = [g.detach() for g in grads if isinstance(g, torch.Tensor)]
        norm = None
        with torch.no_grad():
            if tensors:
                norm = torch.nn.utils.get_total_norm(tensors)
                if self._scale:
                    scale = self.model.optimizer.dynamic_scale
                    scale = getattr(scale, "value", scale)
                    norm = norm / scale  # gradients of the scaled loss: the unscaled norm
            y_pred = seen.y_pred.detach() if isinstance(seen.y_pred, torch.Tensor) else None
            targets = class_targets(seen.y, y_pred)
        epoch, batch = self.position()
        self.tap.step(
            loss=seen.loss.detach(),
            outputs=y_pred if targets is not None else None,
            targets=targets,
            batch_size=None if targets is not None or y_pred is None else int(y_pred.shape[0]),
            grad_norm=norm,
            extra={"lr": lr} if lr is not None else None,
            epoch=epoch,
            batch=batch,
        )
        if self.tap.should_stop:
            self.model.stop_training = True
