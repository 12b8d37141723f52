"""Keras on the PyTorch backend: each training step goes straight to ``tap.step()``.

The step's tensors are torch tensors on the training device, so batchtap's own metrics and
pipeline run unchanged: the loss ``compute_loss`` returned (sample-weighted as Keras weights it),
accuracy from ``y_pred`` and the targets (class indices, or one-hot rows turned into indices on the
device), the gradient norm (unscaled under a ``LossScaleOptimizer``) and the learning rate the
step used (schedules included), taken before ``apply`` advances the iteration count.

With several outputs, per output (as on TensorFlow): ``loss/<head>``, the value Keras' own
per-output tracker receives (its ``update_state`` is watched: nothing is computed twice), and
``accuracy/<head>`` for heads of class scores. The losses go to ``tap.step`` as extras; each
accuracy is a metric of the run (``_keras_accuracy.HeadAccuracy``: held to [0, 1], weighted by the
head's counted targets across ranks, higher is better), as on TensorFlow.

A non-finite gradient norm with a finite loss stops the run at its step (the Tap's NaN guard
watches the loss only): the step's "first non-finite norm" index is kept on the device and copied
to a host float each step (page-locked and asynchronous on CUDA), read there without a device
sync, as the Tap's own guard reads the loss: the same step on the CPU, within the copy's lag on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from batchtap.integrations._keras_accuracy import HeadAccuracy, head_accuracies
from batchtap.integrations._keras_heads import head_pair, like, model_heads
from batchtap.integrations._keras_hooks import Hooks, optimizer_facts
from batchtap.tap import Tap

__all__ = ["NormWatch", "TorchRecorder", "class_targets"]


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


class NormWatch:
    """The index of the first step whose gradient norm is not finite, visible on the host with no
    device sync: kept on the device, copied each step to a host float (asynchronously into
    page-locked memory on CUDA, so the host sees it within the copy's lag) read through a numpy view."""

    def __init__(self) -> None:
        self.count = 0  # steps seen
        self._first: torch.Tensor | None = None  # on the device: -1, or the first bad step's index
        self._host: torch.Tensor | None = None
        self._view: np.ndarray | None = None

    def see(self, norm: torch.Tensor) -> int | None:
        """Queue this step's check; the index of the first non-finite norm the host sees, else None."""
        if self._first is None:
            if norm.device.type == "cpu":
                self._view = np.full(1, -1.0, dtype=np.float32)
                # the host float itself is the state: updated in place, no copy (numpy shares its memory)
                self._host = self._first = torch.from_numpy(self._view)
            else:
                self._first = torch.full((1,), -1.0, device=norm.device)
                # page-locked: the copy below is asynchronous on CUDA
                self._host = torch.full((1,), -1.0, dtype=torch.float32, pin_memory=True)
                self._view = self._host.numpy()
        index, self.count = self.count, self.count + 1
        first = self._first
        # this step's index, unless an earlier one is kept or this norm is finite (in place)
        first.masked_fill_((first < 0) & ~torch.isfinite(norm), float(index))
        assert self._host is not None and self._view is not None
        if self._host is not first:
            self._host.copy_(first, non_blocking=True)
        seen = float(self._view[0])
        return int(seen) if seen >= 0 else None


class TorchRecorder:
    """Hooks a Keras model on the torch backend and calls ``tap.step`` once per training step."""

    def __init__(self, model: Any, tap: Tap, position: Callable[[], tuple[int, int]]) -> None:
        self.model = model
        self.tap = tap
        self.position = position  # (epoch, batch) of the step being recorded
        self._holder, self._scale = optimizer_facts(model.optimizer)
        self.no_loss = False  # a train_step applied gradients without compute_loss: nothing recorded
        self.hooks = Hooks(model, self._on_apply)
        self._heads, self._accuracy_heads = model_heads(model)
        self._head_losses: dict[str, Any] = {}
        # per head, its accuracy metric in the run (added at the first step: the run is open then)
        self._accuracies: dict[str, HeadAccuracy] | None = None
        self._looked_up = False
        if len(self._heads) > 1:
            self._watch_head_losses()
        # under loss scaling a non-finite norm is the LossScaleOptimizer's skip, not a divergence
        self._norms = NormWatch() if tap.nan_guard and not self._scale else None

    def remove(self) -> None:
        self.hooks.remove()

    def _watch_head_losses(self) -> None:
        """Keep what Keras' per-output loss trackers receive (``<head>_loss``: the unweighted loss
        of that output; built by ``fit()`` before the callbacks start)."""
        compiled = vars(self.model).get("_compile_loss")
        entries = list(getattr(compiled, "_flat_losses", None) or [])
        trackers = list(getattr(compiled, "metrics", None) or [])
        for entry, tracker in zip(entries, trackers):  # Keras pairs them in this order
            head = str(getattr(entry, "name", ""))
            if head in self._heads and callable(getattr(tracker, "update_state", None)):
                self.hooks.replace(tracker, "update_state", self._keeper(head, tracker.update_state))

    def _keeper(self, head: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def update_state(values: Any, *args: Any, **kwargs: Any) -> Any:
            self._head_losses[head] = values
            return original(values, *args, **kwargs)

        return update_state

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
        head_losses, self._head_losses = self._head_losses, {}
        if seen is None or not isinstance(seen.loss, torch.Tensor):
            self.no_loss = True  # a custom train_step without compute_loss: said once, nothing recorded
            return
        tensors = [g.detach() for g in grads if isinstance(g, torch.Tensor)]
        norm = None
        extra: dict[str, torch.Tensor | float] = {"lr": lr} if lr is not None else {}
        with torch.no_grad():
            if tensors:
                norm = torch.nn.utils.get_total_norm(tensors)
                if self._scale:
                    scale = self.model.optimizer.dynamic_scale
                    scale = getattr(scale, "value", scale)
                    norm = norm / scale  # gradients of the scaled loss: the unscaled norm
            if len(self._heads) > 1:
                y_pred, targets, samples = None, None, self._per_head(seen, head_losses, extra)
            else:
                y_pred = seen.y_pred.detach() if isinstance(seen.y_pred, torch.Tensor) else None
                targets = class_targets(seen.y, y_pred)
                samples = None if targets is not None or y_pred is None else int(y_pred.shape[0])
        epoch, batch = self.position()
        self.tap.step(
            loss=seen.loss.detach(),
            outputs=y_pred if targets is not None else None,
            targets=targets,
            batch_size=samples,
            grad_norm=norm,
            extra=extra or None,
            epoch=epoch,
            batch=batch,
        )
        stop = self.tap.should_stop  # the loss guard's verdict (polled once a step)
        if not stop and self._norms is not None and norm is not None:
            first = self._norms.see(norm)
            if first is not None:
                step = self.tap.steps_recorded - self._norms.count + first  # the bad step's own number
                self.tap.request_stop(
                    f"non-finite gradient norm at step {step} (the loss was finite)", step=step, metric="grad_norm"
                )
                stop = True
        if stop:
            self.model.stop_training = True

    def _per_head(self, seen: Any, head_losses: dict[str, Any], extra: dict[str, torch.Tensor | float]) -> int | None:
        """``loss/<head>`` and ``accuracy/<head>`` into ``extra``; the batch's samples (one per
        sample, not one per head)."""
        keras = _keras()
        for head, value in head_losses.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                extra[f"loss/{head}"] = value.detach().to(torch.float32)
        y_pred = seen.y_pred
        flat = [t for t in keras.tree.flatten(y_pred) if isinstance(t, torch.Tensor)]
        if not self._looked_up:
            self._looked_up = True
            self._accuracies = head_accuracies(self.tap, self._accuracy_heads)
        if self._accuracy_heads and seen.y is not None:
            y = like(keras, seen.y, y_pred, self.model)
            for head in self._accuracy_heads:
                y_t, y_p = head_pair(keras, head, self._heads, y, y_pred)
                y_p = y_p.detach() if isinstance(y_p, torch.Tensor) else None
                wanted = class_targets(y_t, y_p)
                if wanted is None or y_p is None:
                    continue  # no class targets: the head's accuracy is absent this step
                if self._accuracies is not None:
                    self._accuracies[head].give(y_p, wanted)
                else:  # a run that recorded steps before without the metrics: a plain value, as then
                    extra[f"accuracy/{head}"] = (y_p.argmax(-1) == wanted).to(torch.float32).mean()
        return int(flat[0].shape[0]) if flat and flat[0].dim() else None


def _keras() -> Any:
    import keras  # type: ignore[import-untyped]

    return keras
