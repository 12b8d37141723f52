"""TensorFlow capture: a ``tf.Variable`` ring written inside the compiled step, read once per flush.

Inside a ``tf.function`` (XLA included) Python runs only while tracing, and ``tf.py_function``
would read the host every step (and fails under XLA). So a step adds TensorFlow ops only: its
values are stacked into one float32 row and written into slot ``count % capacity`` of a
preallocated ``[capacity, width]`` variable with one ``scatter_nd_update`` (one row, not the whole
ring), and an int64 counter advances. The host reads the counter and the ring at a flush (two
reads per flush, none per step) and hands the rows to :func:`._keras_feed.feed_rows`, batchtap's
existing pipeline.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchtap._optional import require
from batchtap.errors import ConfigError, InputError
from batchtap.integrations._keras_feed import HostBlock, feed_rows, split_calls
from batchtap.tap import Tap

__all__ = ["TFCapture", "BASE_COLUMNS"]

log = logging.getLogger("batchtap")

#: the ring's fixed columns, in order; extras follow
BASE_COLUMNS = ("loss", "samples", "hits", "kept", "grad_norm", "lr")

#: metrics whose values come from the Tap's own clock: on TensorFlow rows reach the Tap at the flush,
#: so those clocks would time the hand-over, not the steps (step time is measured here instead)
_CLOCK_METRICS = frozenset({"StepTime", "Throughput", "DataTime"})
#: metrics that need PyTorch objects or tensors that a TensorFlow step does not have
_TORCH_METRICS = frozenset({"Accuracy", "LearningRate", "GradNorm", "LossScale", "Memory", "Custom"})


def check_tap_for_tf(tap: Tap) -> None:
    """Refuse a Tap whose metrics cannot be fed from a TensorFlow ring (see ``tf_metrics``)."""
    metrics: Sequence[Any] = tap.metrics
    names = {type(m).__name__ for m in metrics}
    bad = sorted(names & (_CLOCK_METRICS | _TORCH_METRICS))
    if bad:
        raise ConfigError(
            f"this Tap's metrics {bad} cannot be measured on the TensorFlow backend (they time the Tap's "
            "own calls or need PyTorch tensors), got a Tap with metrics "
            f"{sorted(names)}; fix: bt.Tap(metrics=[bt.metrics.Loss()], ...) — loss, accuracy, lr, "
            "grad_norm, step_time and throughput are recorded from the TensorFlow step"
        )


def _class_scores(tf: Any, outputs: Any) -> Any:
    """What to take the top-1 class of: ``outputs``, or, where ``outputs`` is a traced ``Softmax``
    op's result (a Keras ``softmax`` output layer), that op's logits.

    Why: Keras computes the loss of a softmax output from its logits, so the softmax itself is
    pruned from the step unless something reads it; reading it for accuracy kept it alive and cost
    ~80-110 us per step on the TensorFlow CPU build with oneDNN (measured: a tiny MLP whose whole
    compiled step is ~0.27 ms), the argmax of the logits ~6 us. Softmax never reverses the order of
    two logits, so the top class is the same, except where two distinct top logits round to the
    same float32 probability (Keras' accuracy then counts the lower class index, this the class
    with the larger logit).
    """
    op = None if tf.executing_eagerly() else getattr(outputs, "op", None)
    if op is None or op.type != "Softmax":
        return outputs
    return op.inputs[0]  # the raw Softmax op always normalizes the last axis, the one argmax reads


def _tf() -> Any:
    return require("tensorflow", extra="keras", purpose="batchtap's TensorFlow capture")


class TFCapture:
    """Per-step values of a TensorFlow training step, captured on the device, stored by a Tap.

    Call :meth:`step` inside your ``tf.function`` train step (it adds ops; it reads nothing), and
    :meth:`advance` on the host after each call of that function (bookkeeping and the flush when
    due; no device read except at a flush). The Tap's pipeline then validates, runs the rules and
    stores the rows as it does for PyTorch.

    Args:
        tap: the Tap that stores the rows; a run must be open when rows are flushed. Build it with
            ``metrics=[bt.metrics.Loss()]``: the other values come from the TensorFlow step (the
            default metrics would time the Tap's own calls; such a Tap is refused).
        flush_every: read the ring after about this many steps (default: ``tap.flush_every``).
        steps_per_call: steps one call of the compiled function runs (Keras' ``steps_per_execution``).
        extras: names of further values :meth:`step` receives in ``extra=``.

    Example (not run here: it needs TensorFlow)::

        cap = TFCapture(tap)
        @tf.function(jit_compile=True)
        def train_step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            cap.step(loss=loss, outputs=logits, targets=y, grad_norm=tf.linalg.global_norm(grads))
        with tap.run(name="tf"):
            for x, y in dataset:
                train_step(x, y)
                cap.advance()
                if cap.should_stop:
                    break
            cap.flush()
    """

    def __init__(
        self, tap: Tap, *, flush_every: int | None = None, steps_per_call: int = 1, extras: Sequence[str] = ()
    ) -> None:
        tf = _tf()
        check_tap_for_tf(tap)
        flush_every = tap.flush_every if flush_every is None else flush_every
        for label, value in (("flush_every", flush_every), ("steps_per_call", steps_per_call)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be an integer >= 1, got {value!r}")
        taken = set(BASE_COLUMNS) | {"accuracy", "step_time", "throughput"}
        for name in extras:
            if not isinstance(name, str) or not name or name in taken:
                raise ConfigError(f"extras must be new non-empty names (not one of {sorted(taken)}), got {name!r}")
        self.tap = tap
        self.flush_every = flush_every
        self.steps_per_call = steps_per_call
        self.columns = BASE_COLUMNS + tuple(extras)
        # room for everything between two flushes, twice: a flush happens at most one call late
        self.capacity = 2 * (flush_every + steps_per_call)
        self._ring = tf.Variable(
            tf.zeros([self.capacity, len(self.columns)], tf.float32), trainable=False, name="batchtap_ring"
        )
        self._count = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="batchtap_count")
        self._taken = 0  # rows handed to the Tap (host)
        self._pending = 0  # steps run since the last flush, as the host counts them (an upper bound)
        self._calls: list[tuple[float, int]] = []  # host seconds and planned steps of each call since
        self._call_start: float | None = None
        self.epoch = 0
        self.batch = 0  # batch index of the next row within its epoch
        self.host_reads = 0  # device reads this capture made (two per flush that found rows)

    # ------------------------------------------------------------------ inside the compiled step

    def step(
        self,
        loss: Any,
        *,
        outputs: Any = None,
        targets: Any = None,
        grad_norm: Any = None,
        lr: Any = None,
        samples: Any = None,
        extra: Mapping[str, Any] | None = None,
        record: Any = None,
    ) -> None:
        """Add the ops that write this step's row. Runs while tracing; adds no host read.

        Args:
            loss: the step's 0-dim loss tensor.
            outputs: class scores ``[N, C]`` (or ``[..., C]``) for accuracy; probabilities work too.
            targets: class indices (``[N]``, ``[N, 1]``) or one-hot/probability rows like ``outputs``.
            grad_norm: the global gradient norm (e.g. ``tf.linalg.global_norm(grads)``).
            lr: the learning rate the step used.
            samples: samples in the batch (default: the first dimension of ``outputs``).
            extra: values for the names given as ``extras``.
            record: a boolean tensor; when False the row is written but the counter does not
                advance (the row is dropped). Keras' NaN freeze uses it.
        """
        tf = _tf()
        nan = tf.constant(math.nan, tf.float32)
        hits, kept = self._accuracy_ops(tf, outputs, targets, nan)
        if samples is None:
            samples = tf.shape(outputs)[0] if outputs is not None else nan
        extra = dict(extra or {})
        unknown = set(extra) - set(self.columns[len(BASE_COLUMNS) :])
        if unknown:
            raise InputError(
                f"extra values {sorted(unknown)} were not declared; pass TFCapture(..., extras={sorted(unknown)})"
            )
        values = [loss, samples, hits, kept, grad_norm, lr] + [extra.get(n) for n in self.columns[len(BASE_COLUMNS) :]]
        row = tf.stack([nan if v is None else tf.cast(tf.reshape(v, []), tf.float32) for v in values])
        slot = tf.math.floormod(self._count.read_value(), self.capacity)
        self._ring.scatter_nd_update(tf.reshape(slot, [1, 1]), tf.reshape(row, [1, -1]))
        advance = tf.constant(1, tf.int64) if record is None else tf.cast(record, tf.int64)
        self._count.assign_add(advance)

    @staticmethod
    def _accuracy_ops(tf: Any, outputs: Any, targets: Any, nan: Any) -> tuple[Any, Any]:
        """Hits and counted targets of top-1 accuracy (NaN, NaN where the shapes allow none)."""
        if outputs is None or targets is None:
            return nan, nan
        outputs, targets = tf.convert_to_tensor(outputs), tf.convert_to_tensor(targets)
        classes = outputs.shape[-1] if outputs.shape.rank else None
        if not outputs.shape.rank or outputs.shape.rank < 2 or classes is None or classes < 2:
            return nan, nan  # a single score per sample (binary, regression): no class to pick
        predicted = tf.argmax(_class_scores(tf, outputs), axis=-1)
        if targets.shape.rank == outputs.shape.rank and targets.shape[-1] == classes:
            wanted = tf.argmax(targets, axis=-1)  # one-hot (categorical) targets
        else:
            wanted = tf.reshape(tf.cast(targets, tf.int64), tf.shape(predicted))  # class indices
        hits = tf.reduce_sum(tf.cast(tf.equal(predicted, wanted), tf.float32))
        return hits, tf.cast(tf.size(predicted), tf.float32)

    # ------------------------------------------------------------------ on the host

    @property
    def should_stop(self) -> bool:
        """The Tap's stop request (NaN guard, rules), as far as the flushed rows told it."""
        return self.tap.should_stop

    def call_started(self) -> None:
        """Mark the start of a call of the compiled function (its host time becomes step time)."""
        self._call_start = time.perf_counter()

    def advance(self, steps: int | None = None) -> None:
        """After a call of the compiled function: count its steps, flush when due. Host only."""
        now = time.perf_counter()
        planned = self.steps_per_call if steps is None else steps
        if self._call_start is not None:
            self._calls.append((now - self._call_start, planned))
            self._call_start = None
        else:
            self._calls.append((math.nan, planned))
        self._pending += planned
        if self._pending >= self.flush_every:
            self.flush()

    def new_epoch(self, epoch: int) -> None:
        """Rows from here on belong to ``epoch`` (flush first so no block spans two epochs)."""
        self.epoch = epoch
        self.batch = 0

    def flush(self) -> int:
        """Read the ring once and hand its new rows to the Tap; returns how many it took."""
        rows = self._take()
        self._pending = 0
        calls, self._calls = self._calls, []
        if rows is None:
            return 0
        count = len(rows)
        step_time = split_calls(calls, count)
        samples = rows[:, 1]
        with np.errstate(invalid="ignore", divide="ignore"):
            values = {
                "accuracy": rows[:, 2] / rows[:, 3],
                "grad_norm": rows[:, 4],
                "lr": rows[:, 5],
                "step_time": step_time,
                "throughput": samples / step_time,
            }
        for index, name in enumerate(self.columns[len(BASE_COLUMNS) :], start=len(BASE_COLUMNS)):
            values[name] = rows[:, index]
        block = HostBlock(
            loss=rows[:, 0],
            samples=samples,
            epoch=np.full(count, self.epoch),
            batch=np.arange(self.batch, self.batch + count),
            values=values,
        )
        self.batch += count
        return feed_rows(self.tap, block)

    def _take(self) -> np.ndarray | None:
        """The rows written since the last flush, oldest first, as float64 (None: no new row)."""
        # sync: flush — one read of the counter, one of the ring, per flush; never per step.
        count = int(self._count.numpy())
        self.host_reads += 1
        new = count - self._taken
        if new <= 0:
            return None
        # sync: flush — see above.
        ring = np.asarray(self._ring.numpy(), dtype=np.float64)
        self.host_reads += 1
        lost = max(new - self.capacity, 0)
        if lost:
            log.warning("batchtap: %d TensorFlow rows were overwritten before a flush read them", lost)
        first = self._taken + lost
        slots = np.arange(first, count) % self.capacity
        self._taken = count
        return ring[slots]
