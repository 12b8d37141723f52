"""Instance-level hooks on a Keras model: ``compute_loss`` (loss, y, y_pred) and the optimizer's
``apply`` (gradients). Backend-neutral; what each backend records lives in ``_keras_torch.py`` and
``_keras_tf.py``.

Hooks are set on the instance (never the class) and removed at the end of ``fit()``; the train
function is rebuilt both times, so a traced function never keeps (or lacks) them by accident.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["Seen", "Hooks", "optimizer_facts"]


@dataclasses.dataclass
class Seen:
    """What ``compute_loss`` saw in the current training step (tensors of the backend, or symbols
    while TensorFlow traces)."""

    loss: Any
    y: Any
    y_pred: Any


class Hooks:
    """Wrap ``model.compute_loss`` and ``model.optimizer.apply`` on the instances.

    ``on_apply(grads, variables, apply)`` replaces the optimizer's ``apply``: it must call
    ``apply(grads, variables)`` (or decide not to) and may use :attr:`seen`.
    """

    def __init__(self, model: Any, on_apply: Callable[[Any, Any, Callable[..., Any]], Any]) -> None:
        self.model = model
        self.optimizer = model.optimizer
        self.seen: Seen | None = None
        original_loss = model.compute_loss
        original_apply = self.optimizer.apply

        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = original_loss(*args, **kwargs)
            if kwargs.get("training", True):  # test_step passes training=False
                x, y, y_pred = (list(args) + [None] * 3)[:3]
                y = kwargs.get("y", y)
                y_pred = kwargs.get("y_pred", y_pred)
                self.seen = Seen(loss, y, y_pred)
            return loss

        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            return on_apply(grads, trainable_variables, original_apply)

        model.compute_loss = compute_loss
        self.optimizer.apply = apply

    def remove(self) -> None:
        """Take the hooks off the instances again (the class methods show through)."""
        for owner, name in ((self.model, "compute_loss"), (self.optimizer, "apply")):
            if name in vars(owner):
                delattr(owner, name)


def optimizer_facts(optimizer: Any) -> tuple[Any, bool]:
    """The optimizer that holds the learning rate, and whether gradients arrive scaled by a
    ``LossScaleOptimizer``'s ``dynamic_scale`` (made when that optimizer is built: read it at
    ``apply`` time, not before)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return inner, True
    return optimizer, False
