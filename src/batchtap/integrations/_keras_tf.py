"""Keras on the TensorFlow backend: the step's values go into a :class:`TFCapture` ring.

The hooks run while Keras traces its train function (``jit_compile`` or not, any
``steps_per_execution``), so each step adds a few ops: top-1 accuracy, the gradient norm
(unscaled under a ``LossScaleOptimizer``), the learning rate the step used, one ring row. The host
reads the ring once per flush.

The NaN guard, in the graph: with ``tap.nan_guard`` a non-finite loss sets a device flag; from the
next step on the optimizer update is skipped (``tf.cond``) and no row is recorded, so training stops
at the NaN step even though the host only learns of it at the next flush, where
``model.stop_training`` is set. (Under ``run_eagerly=True`` a ``tf.cond`` would read its predicate
on the host every step: there the stop waits for the flush.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchtap.integrations._keras_hooks import Hooks, optimizer_facts
from batchtap.integrations._tf_ring import TFCapture, _tf
from batchtap.tap import Tap

__all__ = ["TFRecorder"]


class TFRecorder:
    """Hooks a Keras model on the TensorFlow backend and fills a :class:`TFCapture`."""

    def __init__(self, model: Any, tap: Tap, *, flush_every: int | None, freeze_on_nan: bool) -> None:
        tf = _tf()
        self.model = model
        self.tap = tap
        self.capture = TFCapture(tap, flush_every=flush_every, steps_per_call=int(model.steps_per_execution or 1))
        self._holder, self._scale = optimizer_facts(model.optimizer)
        self.freeze_on_nan = freeze_on_nan
        self._stopped = tf.Variable(False, trainable=False, name="batchtap_stopped")
        optimizer = model.optimizer
        if freeze_on_nan and not optimizer.built and model.trainable_variables:
            # built here, not inside the tf.cond below: variables cannot be made in a cond branch
            optimizer.build(model.trainable_variables)
        self.hooks = Hooks(model, self._on_apply)

    def remove(self) -> None:
        self.hooks.remove()

    def _on_apply(self, grads: Any, variables: Any, apply: Callable[..., Any]) -> Any:
        tf = _tf()
        seen, self.hooks.seen = self.hooks.seen, None
        if seen is None:
            return apply(grads, variables)  # a custom train_step without compute_loss
        lr = getattr(self._holder, "learning_rate", None)  # before apply: this step's rate
        present = [g for g in grads if g is not None]
        norm = tf.linalg.global_norm(present) if present else None
        if norm is not None and self._scale:
            norm = norm / tf.cast(self.model.optimizer.dynamic_scale, norm.dtype)  # gradients of the scaled loss
        eager = tf.executing_eagerly()
        if not self.freeze_on_nan or eager:
            self.capture.step(seen.loss, outputs=seen.y_pred, targets=seen.y, grad_norm=norm, lr=lr)
            return apply(grads, variables)
        stopped = self._stopped.read_value()
        self.capture.step(
            seen.loss, outputs=seen.y_pred, targets=seen.y, grad_norm=norm, lr=lr, record=tf.logical_not(stopped)
        )

        def step() -> Any:
            apply(grads, variables)
            return tf.constant(True)

        tf.cond(stopped, lambda: tf.constant(False), step)
        self._stopped.assign(tf.logical_or(stopped, tf.logical_not(tf.math.is_finite(seen.loss))))
        return None

    def reset(self) -> None:
        """A new fit(): lift the NaN freeze (the Tap decides whether this run stops)."""
        self._stopped.assign(False)
