"""Instance-level hooks on a Keras model: ``compute_loss`` (loss, y, y_pred, sample weights), the
optimizer's ``apply`` (gradients), optionally ``train_step`` (around the whole step) and a custom
step's own loss tracker. Backend-neutral; what each backend records lives in ``_keras_torch.py``
and ``_keras_tf.py``.

Hooks are set on the instances (never the class) and removed at the end of ``fit()``; the train
function is rebuilt both times, so a traced function never keeps (or lacks) them by accident.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["Seen", "Hooks", "optimizer_facts", "loss_trackers"]


@dataclasses.dataclass
class Seen:
    """What ``compute_loss`` saw in the current training step (tensors of the backend, or symbols
    while TensorFlow traces)."""

    loss: Any
    y: Any
    y_pred: Any
    sample_weight: Any = None


def loss_trackers(model: Any) -> list[Any]:
    """A custom ``train_step``'s own loss metrics: metrics named ``loss`` that are not Keras' own
    tracker (keras.io's "going lower-level" ``self.loss_tracker.update_state(loss)``)."""
    own = vars(model).get("_loss_tracker")
    found: dict[int, Any] = {}
    candidates = list(getattr(model, "metrics", []) or []) + list(vars(model).values())
    for metric in candidates:
        if getattr(metric, "name", None) == "loss" and callable(getattr(metric, "update_state", None)):
            if metric is not own:
                found[id(metric)] = metric
    return list(found.values())


class Hooks:
    """Wrap ``model.compute_loss`` and ``model.optimizer.apply`` on the instances.

    ``on_apply(grads, variables, apply)`` replaces the optimizer's ``apply``: it must call
    ``apply(grads, variables)`` (or decide not to) and may use :attr:`seen`. With ``around_step``,
    ``model.train_step`` is wrapped too: ``around_step(data, train_step)`` must call it and return
    its result; a custom step's own loss tracker (see :func:`loss_trackers`) is then watched, its
    first value of the step kept in :attr:`tracked`.
    """

    def __init__(
        self,
        model: Any,
        on_apply: Callable[[Any, Any, Callable[..., Any]], Any],
        *,
        around_step: Callable[[Any, Callable[[Any], Any]], Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = model.optimizer
        self.seen: Seen | None = None
        self.tracked: Any = None
        self._undo: list[tuple[Any, str]] = []
        original_loss = model.compute_loss
        original_apply = self.optimizer.apply

        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = original_loss(*args, **kwargs)
            if kwargs.get("training", True):  # test_step passes training=False
                x, y, y_pred, sample_weight = (list(args) + [None] * 4)[:4]
                self.seen = Seen(
                    loss,
                    kwargs.get("y", y),
                    kwargs.get("y_pred", y_pred),
                    kwargs.get("sample_weight", sample_weight),
                )
            return loss

        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            return on_apply(grads, trainable_variables, original_apply)

        self._set(model, "compute_loss", compute_loss)
        self._set(self.optimizer, "apply", apply)
        if around_step is not None:
            original_step = model.train_step

            def train_step(data: Any) -> Any:
                return around_step(data, original_step)

            self._set(model, "train_step", train_step)
            for tracker in loss_trackers(model):
                self._watch(tracker)

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name`` on the instance until :meth:`remove` (what else a recorder hooks)."""
        setattr(owner, name, value)
        self._undo.append((owner, name))

    _set = replace

    def _watch(self, tracker: Any) -> None:
        original = tracker.update_state

        def update_state(values: Any, *args: Any, **kwargs: Any) -> Any:
            if self.tracked is None:
                self.tracked = values
            return original(values, *args, **kwargs)

        self._set(tracker, "update_state", update_state)

    def remove(self) -> None:
        """Take the hooks off the instances again (the class methods show through)."""
        for owner, name in reversed(self._undo):
            if name in vars(owner):
                delattr(owner, name)
        self._undo.clear()


def optimizer_facts(optimizer: Any) -> tuple[Any, bool]:
    """The optimizer that holds the learning rate, and whether gradients arrive scaled by a
    ``LossScaleOptimizer``'s ``dynamic_scale`` (made when that optimizer is built: read it at
    ``apply`` time, not before)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return inner, True
    return optimizer, False
