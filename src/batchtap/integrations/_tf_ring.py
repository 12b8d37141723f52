"""TensorFlow capture: a ``tf.Variable`` ring written inside the compiled step, read once per flush.

Inside a ``tf.function`` (XLA included) Python runs only while tracing, and ``tf.py_function``
would read the host every step (and fails under XLA). So a step adds TensorFlow ops only: its
values are stacked into one float32 row and written into slot ``count % capacity`` of a
preallocated ``[capacity, width]`` variable with one ``scatter_nd_update`` (one row, not the whole
ring), and an int64 counter advances. The host reads the counter and the ring at a flush (two
reads per flush, none per step) and hands the rows to the Tap's pipeline as one block
(:meth:`batchtap.Tap.hand_over`, decoded by the metrics of ``_tf_metrics.py``): the same domain
checks, anomaly events, NaN stop, rules and sinks as a PyTorch block. A value a step did not have is
marked absent by a presence column (``name?``), never by NaN.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchtap._optional import require
from batchtap._run import HandedRows
from batchtap.errors import ConfigError, InputError
from batchtap.integrations._keras_feed import split_calls
from batchtap.integrations._tf_metrics import TFPlan, plan_for
from batchtap.metrics.layout import Layout
from batchtap.records import EventKind
from batchtap.tap import Tap

__all__ = ["TFCapture"]

log = logging.getLogger("batchtap")

#: names TFCapture's own columns take: an extra cannot have one
_TAKEN = frozenset({"loss", "samples", "skipped", "lr", "grad_norm", "accuracy", "step_time", "throughput"})


def _class_scores(tf: Any, outputs: Any) -> Any:
    """What to take the top-1 class of: ``outputs``, or, where ``outputs`` is a traced ``Softmax``
    op's result (a Keras ``softmax`` output layer), that op's logits.

    Why: Keras computes the loss of a softmax output from its logits, so the softmax itself is
    pruned from the step unless something reads it; reading it for accuracy kept it alive and cost
    ~80-110 us per step on the TensorFlow CPU build with oneDNN (measured: a tiny MLP whose whole
    compiled step is ~0.27 ms), the argmax of the logits ~6 us. Softmax never reverses the order of
    two logits, so the top class is the same, except where two distinct top logits round to the
    same float32 probability (Keras' accuracy then counts the lower class index, this the class
    with the larger logit). A row's batch size likewise: :func:`batch_size`.
    """
    op = None if tf.executing_eagerly() else getattr(outputs, "op", None)
    if op is None or op.type != "Softmax":
        return outputs
    return op.inputs[0]  # the raw Softmax op always normalizes the last axis, the one argmax reads


def batch_size(tf: Any, outputs: Any) -> Any:
    """The first dimension of ``outputs``, read from the logits of a Keras ``softmax`` or
    ``sigmoid`` output. Keras computes those outputs' losses from their logits, so plain ``fit()``
    prunes the activation itself, and ``tf.shape`` of it would keep it alive wherever the batch
    dimension is unknown while tracing, as in ``fit()`` (a softmax: ~0.14 ms a step on a tiny MLP,
    ``bench/keras_fit.py --model mlp --calls 1000``). Graph ops only."""
    source = getattr(outputs, "_keras_logits", None)  # what Keras' activations leave for its losses
    if source is None and not tf.executing_eagerly():
        op = getattr(outputs, "op", None)
        if op is not None and op.type in ("Softmax", "Sigmoid"):
            source = op.inputs[0]  # elementwise or along one axis: the same shape
    return tf.shape(outputs if source is None else source)[0]


def _scalar(tf: Any, value: Any) -> Any:
    """``value`` as a 0-dim float32 tensor; no op for what already is one (a step's row is
    written every step: a reshape or cast that changes nothing is still an op to run)."""
    value = tf.cast(value, tf.float32)  # returns a float32 tensor itself, unchanged
    return value if value.shape.rank == 0 else tf.reshape(value, [])


def _tf() -> Any:
    return require("tensorflow", extra="keras", purpose="batchtap's TensorFlow capture")


def accuracy_ops(tf: Any, outputs: Any, targets: Any) -> tuple[Any, Any] | None:
    """Hits and counted targets of top-1 accuracy, or None where the shapes allow none (one score
    per sample: binary, regression). Targets: class indices (``[N]``, ``[N, 1]``) or one-hot /
    probability rows of the outputs' shape. Graph ops only."""
    if outputs is None or targets is None:
        return None
    outputs, targets = tf.convert_to_tensor(outputs), tf.convert_to_tensor(targets)
    rank = outputs.shape.rank
    classes = outputs.shape[-1] if rank else None
    if not rank or rank < 2 or classes is None or classes < 2:
        return None
    predicted = tf.argmax(_class_scores(tf, outputs), axis=-1)
    if targets.shape.rank == rank and targets.shape[-1] == classes:
        wanted = tf.argmax(targets, axis=-1)  # one-hot (categorical) targets
    else:
        wanted = tf.reshape(tf.cast(targets, tf.int64), tf.shape(predicted))  # class indices ([N] or [N, 1])
    hits = tf.reduce_sum(tf.cast(tf.equal(predicted, wanted), tf.float32))
    return hits, tf.cast(tf.size(predicted), tf.float32)


class TFCapture:
    """Per-step values of a TensorFlow training step, captured on the device, stored by a Tap.

    Call :meth:`step` inside your ``tf.function`` train step (it adds ops; it reads nothing), and
    :meth:`advance` on the host after each call of that function (bookkeeping and the flush when
    due; no device read except at a flush). The Tap's pipeline then validates, runs the rules and
    stores the rows as it does for PyTorch.

    Recorded per step: ``loss``, ``accuracy`` (top-1, when ``outputs`` and ``targets`` are class
    scores and class indices or one-hot rows), ``lr`` and ``grad_norm`` (when given),
    ``step_time`` and ``throughput`` (a host clock around each call, spread over its steps), and
    the extras. Any Tap works: its metrics that have no TensorFlow equivalent (memory, data wait,
    custom metrics) are named once in a warning event and left out.

    Args:
        tap: the Tap that stores the rows; a run must be open when rows are flushed.
        flush_every: read the ring after about this many steps (default: ``tap.flush_every``).
        steps_per_call: steps one call of the compiled function runs (Keras' ``steps_per_execution``).
        extras: names of further values :meth:`step` receives in ``extra=``.
        heads: the model's output names when it has several (``loss/<head>``, ``accuracy/<head>``).
        accuracy_heads: the heads that get an accuracy (default: every head).

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
            for epoch in range(3):
                cap.new_epoch(epoch)
                for x, y in dataset:
                    train_step(x, y)
                    cap.advance()
            cap.flush()
    """

    def __init__(
        self,
        tap: Tap,
        *,
        flush_every: int | None = None,
        steps_per_call: int = 1,
        extras: Sequence[str] = (),
        heads: Sequence[str] = (),
        accuracy_heads: Sequence[str] | None = None,
    ) -> None:
        tf = _tf()
        flush_every = tap.flush_every if flush_every is None else flush_every
        for label, value in (("flush_every", flush_every), ("steps_per_call", steps_per_call)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{label} must be an integer >= 1, got {value!r}")
        for name in extras:
            if not isinstance(name, str) or not name or name in _TAKEN or name.startswith(("loss/", "accuracy/")):
                raise ConfigError(
                    f"extras must be new non-empty names (not one of {sorted(_TAKEN)}, nor loss/..., "
                    f"accuracy/...), got {name!r}; fix: rename it"
                )
        self.tap = tap
        self.flush_every = flush_every
        self.steps_per_call = steps_per_call
        self.extras = tuple(extras)
        self.heads = tuple(heads)
        self.plan: TFPlan = plan_for(
            tap.metrics,
            heads=self.heads,
            accuracy_heads=self.heads if accuracy_heads is None else tuple(accuracy_heads),
            extras=self.extras,
        )
        self.columns = self.plan.columns
        index = {name: i for i, name in enumerate(self.columns)}
        layout = Layout(list(self.plan.metrics))
        # ring column of each device column of the block, in the layout's device order
        device = [0] * layout.device_width
        for span, sources in zip(layout.spans, self.plan.sources):
            for k, name in enumerate(sources):
                device[span.device_offset + k] = index[name]
        self._device_columns = np.array(device, dtype=np.int64)
        self._index = index
        # room for everything between two flushes, twice: a flush happens at most one call late
        self.capacity = 2 * (flush_every + steps_per_call)
        self._ring = tf.Variable(
            tf.zeros([self.capacity, len(self.columns)], tf.float32), trainable=False, name="batchtap_ring"
        )
        self._count = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="batchtap_count")
        self._taken = 0  # rows read back by the host
        self._pending = 0  # steps run since the last flush, as the host counts them (an upper bound)
        self._calls: list[tuple[float, int]] = []  # host seconds and planned steps of each call since
        self._call_start: float | None = None
        self._said = False  # the unmeasured metrics were named
        self.epoch = 0
        self.batch = 0  # batch index of the next row within its epoch
        self.host_reads = 0  # device reads this capture made (two per flush that found rows)
        # Called inside the user's tf.function: AutoGraph would try to convert these methods (and
        # warn that it cannot); they hold no Python control flow on tensors to convert.
        for name in ("step", "write"):
            setattr(self, name, tf.autograph.experimental.do_not_convert(getattr(self, name)))

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
            samples: samples in the batch (default: the first dimension of ``outputs``, else of
                ``targets``; throughput is left out without either).
            extra: values for the names given as ``extras``.
            record: a boolean tensor; when False the row is written but not kept.
        """
        tf = _tf()
        extra = dict(extra or {})
        unknown = set(extra) - set(self.extras)
        if unknown:
            raise InputError(
                f"extra values {sorted(unknown)} were not declared; pass TFCapture(..., extras={sorted(unknown)})"
            )
        values: dict[str, Any] = {"loss": loss, "lr": lr, "grad_norm": grad_norm, **extra}
        if samples is None:
            shaped = outputs if outputs is not None else targets
            samples = batch_size(tf, shaped) if shaped is not None else None
        values["samples"] = samples
        counted = accuracy_ops(tf, outputs, targets)
        if counted is not None and "hits/accuracy" in self._index:
            values["hits/accuracy"], values["kept/accuracy"] = counted
        self.write(values, record=record)

    def write(self, values: Mapping[str, Any], *, record: Any = None) -> None:
        """Write one row of named values (the ring's columns; missing ones absent). Graph ops only."""
        tf = _tf()
        unknown = set(values) - set(self.columns)
        if unknown:
            raise InputError(f"values {sorted(unknown)} have no column in this ring ({list(self.columns)})")
        row = []
        for name in self.columns:
            if name.endswith("?"):
                row.append(tf.constant(0.0 if values.get(name[:-1]) is None else 1.0, tf.float32))
                continue
            value = values.get(name)
            if value is None:
                row.append(tf.constant(math.nan if name == "samples" else 0.0, tf.float32))
            else:
                row.append(_scalar(tf, value))
        slot = tf.math.floormod(self._count.read_value(), self.capacity)
        self._ring.scatter_nd_update(tf.reshape(slot, [1, 1]), tf.reshape(tf.stack(row), [1, -1]))
        advance = tf.constant(1, tf.int64) if record is None else tf.cast(record, tf.int64)
        self._count.assign_add(advance)

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
        """Rows from here on belong to ``epoch``: the rows of the epoch before are flushed first."""
        if self.tap.run_info is not None:
            self.flush()
        self.epoch = epoch
        self.batch = 0

    def flush(self) -> int:
        """Read the ring once and hand its new rows to the Tap; returns how many it took."""
        rows, lost = self._take()
        self._pending = 0
        calls, self._calls = self._calls, []
        if rows is None:
            return 0
        count = len(rows)
        step_time = split_calls(calls, count + lost)[lost:]
        column = self._index
        skipped = rows[:, column["skipped"]] > 0
        norm, has_norm = rows[:, column["grad_norm"]], rows[:, column["grad_norm?"]] > 0
        bad_norm = has_norm & ~skipped & ~np.isfinite(norm)
        # a row after a stop (a non-finite loss, a NaN gradient) is a step a PyTorch loop that
        # breaks on should_stop would not have run: the block ends at the first such row
        stops = np.flatnonzero(bad_norm | ~np.isfinite(rows[:, column["loss"]]))
        if stops.size and self.tap.nan_guard:
            count = int(stops[0]) + 1
            rows, step_time, skipped = rows[:count], step_time[:count], skipped[:count]
        rows[skipped, column["grad_norm?"]] = 0.0  # a skipped step's norm is left out
        notes = [
            (
                int(i),
                EventKind.SKIP,
                "the LossScaleOptimizer skipped the optimizer step (inf/NaN gradients of the scaled loss; "
                "the loss scale is halved); the gradient norm of this step is left out",
            )
            for i in np.flatnonzero(skipped)
        ]
        self._say_unmeasured()
        self.batch += lost + count
        rows_out = HandedRows(
            values=rows[:, self._device_columns],
            offsets=np.arange(lost, lost + count),
            epoch=np.full(count, self.epoch),
            batch=np.arange(self.batch - count, self.batch),
            samples=rows[:, column["samples"]],
            step_time=step_time,
            notes=notes,
        )
        first = self.tap.hand_over(self.plan.metrics, rows_out)
        if stops.size and self.tap.nan_guard and bad_norm[count - 1] and not self.tap.should_stop:
            step = first + lost + count - 1
            self.tap.request_stop(
                f"non-finite gradient norm {float(norm[count - 1])!r} at step {step} (the loss was finite)",
                step=step,
                metric="grad_norm",
            )
        return count

    def _say_unmeasured(self) -> None:
        if self._said:
            return
        self._said = True
        if self.plan.unmeasured:
            self.tap.warn(
                f"not measured on TensorFlow, left out of this run: {', '.join(self.plan.unmeasured)} (the Tap "
                "asked for them; TensorFlow steps record loss, accuracy, lr, grad_norm, step_time and throughput)"
            )

    def _take(self) -> tuple[np.ndarray | None, int]:
        """The rows written since the last flush, oldest first, as float64 (None: no new row), and
        how many rows before them were overwritten unread."""
        # sync: flush — one read of the counter, one of the ring, per flush; never per step.
        count = int(self._count.numpy())
        self.host_reads += 1
        new = count - self._taken
        if new <= 0:
            return None, 0
        # sync: flush — see above.
        ring = np.asarray(self._ring.numpy(), dtype=np.float64)
        self.host_reads += 1
        lost = max(new - self.capacity, 0)
        if lost:
            log.warning("batchtap: %d TensorFlow rows were overwritten before a flush read them", lost)
            self.tap.warn(
                f"{lost} TensorFlow steps were overwritten in the ring before a flush read them (left out); "
                "fix: call advance() after every call of the compiled step"
            )
        first = self._taken + lost
        slots = np.arange(first, count) % self.capacity
        self._taken = count
        return ring[slots], lost
