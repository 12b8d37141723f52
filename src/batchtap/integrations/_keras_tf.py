"""Keras on the TensorFlow backend: the step's values go into a :class:`TFCapture` ring.

The hooks run while Keras traces its train function (``jit_compile`` or not, any
``steps_per_execution``), so each step adds a few ops and one ring row, written at the end of
``train_step``: the loss ``compute_loss`` returned (Keras' total: loss weights and regularization
included), per output ``loss/<head>`` (unweighted, as Keras' own per-output trackers) and
``accuracy/<head>`` when the model has several, the gradient norm (dense: an Embedding's
``IndexedSlices`` with repeated rows summed first; unscaled under a ``LossScaleOptimizer``, left out
with a ``skip`` event on a step it skipped), the learning rate the step used. A custom
``train_step`` that never calls ``compute_loss`` is recorded from its own loss tracker (a metric
named ``loss``) when it has one. The host reads the ring once per flush.

The NaN guard, in the graph: with ``tap.nan_guard`` a non-finite loss (or, without loss scaling, a
non-finite gradient norm) sets a device flag; from the next step on the optimizer update is skipped
(``tf.cond``) and no row is recorded, so training stops at that step even though the host only
learns of it at the next flush, where ``model.stop_training`` is set. (Under ``run_eagerly=True`` a
``tf.cond`` would read its predicate on the host every step: there the stop waits for the flush.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchtap.integrations._keras_heads import compiled_losses, head_pair, like, model_heads, resolve, single
from batchtap.integrations._keras_hooks import Hooks, optimizer_facts
from batchtap.integrations._tf_ring import TFCapture, _tf, accuracy_ops, batch_size
from batchtap.tap import Tap

__all__ = ["TFRecorder"]


class TFRecorder:
    """Hooks a Keras model on the TensorFlow backend and fills a :class:`TFCapture`."""

    def __init__(self, model: Any, tap: Tap, *, flush_every: int | None, freeze_on_nan: bool) -> None:
        tf = _tf()
        self.model = model
        self.tap = tap
        heads, accuracy_heads = model_heads(model)
        self.capture = TFCapture(
            tap,
            flush_every=flush_every,
            steps_per_call=int(model.steps_per_execution or 1),
            heads=heads,
            accuracy_heads=accuracy_heads,
        )
        self._heads = heads
        self._accuracy_heads = accuracy_heads
        self._holder, self._scale = optimizer_facts(model.optimizer)
        self.freeze_on_nan = freeze_on_nan
        self.no_loss = False  # traced a train_step in which no loss could be found
        self._applied: dict[str, Any] | None = None
        self._stopped = tf.Variable(False, trainable=False, name="batchtap_stopped")
        optimizer = model.optimizer
        if freeze_on_nan and not optimizer.built and model.trainable_variables:
            # built here, not inside the tf.cond below: variables cannot be made in a cond branch
            optimizer.build(model.trainable_variables)
        self.hooks = Hooks(model, self._on_apply, around_step=self._around_step)

    def remove(self) -> None:
        self.hooks.remove()

    # ------------------------------------------------------------------ traced

    def _around_step(self, data: Any, train_step: Callable[[Any], Any]) -> Any:
        tf = _tf()
        self.hooks.seen, self.hooks.tracked, self._applied = None, None, None
        result = train_step(data)
        seen, tracked, applied = self.hooks.seen, self.hooks.tracked, self._applied
        self.hooks.seen, self.hooks.tracked, self._applied = None, None, None
        loss = seen.loss if seen is not None else tracked
        if loss is None:
            self.no_loss = True  # said on the host after the first call
            return result
        values: dict[str, Any] = {"loss": _mean(tf, loss)}
        record = None
        if applied is not None:
            values.update(lr=applied["lr"], grad_norm=applied["norm"], skipped=applied["skipped"])
            record = applied["record"]
        flat_x = tf.nest.flatten(data)
        if seen is not None:
            values.update(self._outputs(tf, seen))
        elif flat_x:
            values["samples"] = tf.shape(flat_x[0])[0]
        self.capture.write(values, record=record)
        return result

    def _outputs(self, tf: Any, seen: Any) -> dict[str, Any]:
        """Samples, per-head losses and accuracies from what compute_loss saw."""
        keras = _keras()
        y, y_pred = seen.y, seen.y_pred
        flat_pred = keras.tree.flatten(y_pred)
        # from the logits of a softmax/sigmoid output: its own shape would keep it alive (batch_size)
        values: dict[str, Any] = {"samples": batch_size(tf, flat_pred[0])} if flat_pred else {}
        if len(self._heads) <= 1:
            if self._accuracy_heads:
                counted = accuracy_ops(tf, flat_pred[0] if len(flat_pred) == 1 else None, single(keras, y))
                if counted is not None:
                    values["hits/accuracy"], values["kept/accuracy"] = counted
            return values
        y = like(keras, y, y_pred, self.model)
        weights = seen.sample_weight
        for path, loss_fn, _weight, name in compiled_losses(self.model):
            head = str(name)
            if head not in self._heads:
                continue
            y_t, y_p = resolve(path, y), resolve(path, y_pred)
            w = resolve(path, weights) if weights is not None and keras.tree.is_nested(weights) else weights
            # unweighted by the loss weight, as Keras' own per-output tracker records it
            values[f"loss/{head}"] = tf.cast(loss_fn(y_t, y_p, w), tf.float32)
        for head in self._accuracy_heads:
            y_t, y_p = head_pair(keras, head, self._heads, y, y_pred)
            counted = accuracy_ops(tf, y_p, y_t)
            if counted is not None:
                values[f"hits/accuracy/{head}"], values[f"kept/accuracy/{head}"] = counted
        return values

    def _on_apply(self, grads: Any, variables: Any, apply: Callable[..., Any]) -> Any:
        tf = _tf()
        seen = self.hooks.seen
        lr = getattr(self._holder, "learning_rate", None)  # before apply: this step's rate
        present = [g for g in grads if g is not None]
        skipped = None
        unscale = None
        if present and self._scale:
            # LossScaleOptimizer skips a step whose scaled gradients are not all finite
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(tf, g))) for g in present])
            skipped = tf.logical_not(finite)
            # unscaled before squaring: the squares of large scaled gradients overflow float32
            unscale = 1.0 / tf.cast(self.model.optimizer.dynamic_scale, tf.float32)
        squares = [_square_sum(tf, g, unscale) for g in present]
        norm = tf.sqrt(tf.add_n(squares)) if squares else None
        applied = {"lr": lr, "norm": norm, "skipped": skipped, "record": None}
        self._applied = applied
        eager = tf.executing_eagerly()
        if not self.freeze_on_nan or eager:
            return apply(grads, variables)
        stopped = self._stopped.read_value()
        applied["record"] = tf.logical_not(stopped)

        def step() -> Any:
            apply(grads, variables)
            return tf.constant(True)

        tf.cond(stopped, lambda: tf.constant(False), step)
        bad = tf.constant(False)
        if seen is not None:
            finite = tf.math.is_finite(tf.cast(seen.loss, tf.float32))
            bad = tf.logical_not(finite if finite.shape.rank == 0 else tf.reduce_all(finite))
        if norm is not None and not self._scale:
            bad = tf.logical_or(bad, tf.logical_not(tf.math.is_finite(norm)))
        self._stopped.assign(tf.logical_or(stopped, bad))
        return None

    def reset(self) -> None:
        """A new fit(): lift the NaN freeze (the Tap decides whether this run stops)."""
        self._stopped.assign(False)


def _mean(tf: Any, loss: Any) -> Any:
    """The loss as a 0-dim float32 tensor: its mean (a scalar loss, Keras' usual, is its own mean:
    no reduction op added)."""
    loss = tf.cast(loss, tf.float32)
    return loss if loss.shape.rank == 0 else tf.reduce_mean(loss)


def _values(tf: Any, grad: Any) -> Any:
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def _square_sum(tf: Any, grad: Any, factor: Any = None) -> Any:
    """The squared L2 norm of a gradient (times ``factor``) as a dense tensor: an ``IndexedSlices``
    (an Embedding's) has its repeated rows summed first, as the dense gradient holds them."""
    if isinstance(grad, tf.IndexedSlices):
        unique, position = tf.unique(grad.indices)
        dense = tf.math.unsorted_segment_sum(tf.cast(grad.values, tf.float32), position, tf.shape(unique)[0])
    else:
        dense = tf.cast(grad, tf.float32)
    if factor is not None:
        dense = dense * factor
    return tf.reduce_sum(tf.square(dense))


def _keras() -> Any:
    import keras

    return keras
