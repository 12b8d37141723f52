"""Keras model shapes a keras.io user writes, on ONE backend (KERAS_BACKEND), each fit with
BatchtapCallback next to an independent truth of the same training, written as JSON.

The truth is a twin model with the same initial weights trained by a plain ``GradientTape`` loop
(TensorFlow): per batch its losses from the Keras loss functions, accuracy from a Keras metric
reset every batch, the gradient norm of the dense gradients (``tf.convert_to_tensor`` of an
Embedding's ``IndexedSlices``), the rate from the schedule.

    KERAS_BACKEND=tensorflow python tests/integrations/keras_shapes.py out.json [case ...]
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # tests.integrations, for a pipeline process
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import batchtap as bt  # noqa: E402
from batchtap.integrations.keras import BatchtapCallback, TFCapture  # noqa: E402
from batchtap.sinks.base import Sink  # noqa: E402

BACKEND = keras.backend.backend()
BATCH, BATCHES, EPOCHS, FEATURES, CLASSES = 16, 8, 2, 6, 3
LR = 0.05


class Keep(Sink):
    def __init__(self) -> None:
        self.records: list[Any] = []
        self.events: list[Any] = []
        self.ended: list[Any] = []

    def write(self, records: Sequence[Any], events: Sequence[Any] = ()) -> None:
        self.records.extend(records)
        self.events.extend(events)

    def end_run(self, run: Any) -> None:
        self.ended.append(run)

    def result(self) -> dict[str, Any]:
        rows = [{"step": r.step, "epoch": r.epoch, "batch": r.batch, **r.values} for r in self.records if not r.sparse]
        logged = [{"step": r.step, "epoch": r.epoch, **r.values} for r in self.records if r.sparse]
        events = [{"step": e.step, "kind": e.kind.value, "message": e.message, "metric": e.metric} for e in self.events]
        run = self.ended[0] if self.ended else None
        return {
            "rows": rows,
            "logged": logged,
            "events": events,
            "status": run.status.value if run else None,
            "reason": run.stop_reason if run else None,
            "metrics": list(run.metrics) if run else [],
            "environment": {k: v for k, v in (run.environment if run else {}).items() if isinstance(v, (str, int))},
        }


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(BATCH * BATCHES, FEATURES)).astype("float32"), rng.integers(0, CLASSES, BATCH * BATCHES)


def fit(model: Any, x: Any, y: Any, tap: bt.Tap | None = None, **kwargs: Any) -> Keep:
    sink = Keep()
    tap = tap or bt.Tap(sinks=[sink], flush_every=5, flush_seconds=1e6)
    kwargs.setdefault("callbacks", [BatchtapCallback(tap, name="shapes")])
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, **kwargs)
    tap.close()
    return sink


def tape_truth(
    model: Any, x: Any, ys: Any, losses: Callable[[Any, Any, Any], dict[str, Any]], *, sample_weight: Any = None
) -> list[dict[str, float]]:
    """The same training by a plain GradientTape loop (torch backend: ``torch.autograd.grad``) on
    ``model`` (a twin with the same weights): per batch ``losses(y, y_pred, w)`` (a dict holding
    ``loss``, the total), the dense gradient norm, and SGD at ``LR`` through a fresh optimizer."""
    optimizer = keras.optimizers.SGD(LR)
    rows = []
    for k in range(BATCHES * EPOCHS):
        i = (k % BATCHES) * BATCH
        xb = x[i : i + BATCH]
        yb = keras.tree.map_structure(lambda a: a[i : i + BATCH], ys)
        wb = None if sample_weight is None else sample_weight[i : i + BATCH]
        if BACKEND == "torch":
            import torch

            y_pred = model(xb, training=True)
            values = losses(yb, y_pred, wb)
            grads = list(torch.autograd.grad(values["loss"], [v.value for v in model.trainable_variables]))
            norm = float(np.sqrt(sum(float((g.double() ** 2).sum()) for g in grads)))
            optimizer.apply(grads, model.trainable_variables)
        else:
            import tensorflow as tf

            with tf.GradientTape() as tape:
                y_pred = model(xb, training=True)
                values = losses(yb, y_pred, wb)
            grads = tape.gradient(values["loss"], model.trainable_variables)
            dense = [tf.convert_to_tensor(g) for g in grads]
            norm = float(np.sqrt(sum(float(tf.reduce_sum(tf.square(g))) for g in dense)))
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        rows.append({**{n: float(v) for n, v in values.items()}, "grad_norm": norm, "lr": LR})
    return rows


def batch_accuracy(y: Any, y_pred: Any) -> float:
    metric = keras.metrics.SparseCategoricalAccuracy()  # reset per batch: a new one
    metric.update_state(y, y_pred)
    return float(metric.result())


# ---------------------------------------------------------------------- cases


def two_heads(kind: str, tap: bt.Tap | None = None) -> dict[str, Any]:
    """A classifier head and a regression head, loss weights 1 and 0.5, as a dict or a list."""
    x, y = data()
    target_b = (x[:, :1] * 2.0).astype("float32")

    def build() -> Any:
        keras.utils.set_random_seed(3)
        inp = keras.Input((FEATURES,))
        h = keras.layers.Dense(12, activation="relu")(inp)
        a = keras.layers.Dense(CLASSES, activation="softmax", name="head_a")(h)
        b = keras.layers.Dense(1, name="head_b")(h)
        return keras.Model(inp, {"head_a": a, "head_b": b} if kind == "dict" else [a, b])

    model, twin = build(), build()
    twin.set_weights(model.get_weights())
    if kind == "dict":
        loss = {"head_a": "sparse_categorical_crossentropy", "head_b": "mse"}
        weights: Any = {"head_a": 1.0, "head_b": 0.5}
        ys: Any = {"head_a": y, "head_b": target_b}
    else:
        loss, weights, ys = ["sparse_categorical_crossentropy", "mse"], [1.0, 0.5], [y, target_b]
    model.compile(
        keras.optimizers.SGD(LR),
        loss=loss,
        loss_weights=weights,
        metrics=[["accuracy"], ["mae"]] if kind == "list" else {"head_a": "accuracy", "head_b": "mae"},
    )
    sink = fit(model, x, ys, tap)

    def losses(yb: Any, pred: Any, w: Any) -> dict[str, Any]:
        pa, pb = (pred["head_a"], pred["head_b"]) if kind == "dict" else pred
        ya, yb_ = (yb["head_a"], yb["head_b"]) if kind == "dict" else yb
        la = keras.losses.SparseCategoricalCrossentropy()(ya, pa)
        lb = keras.losses.MeanSquaredError()(yb_, pb)
        return {"loss": la + 0.5 * lb, "loss/head_a": la, "loss/head_b": lb, "accuracy/head_a": batch_accuracy(ya, pa)}

    return {**sink.result(), "truth": tape_truth(twin, x, ys, losses)}


def class_weights(labels_2d: bool) -> dict[str, Any]:
    """Class weights (loss weighted, accuracy not); labels as [N] or [N, 1]."""
    x, y = data(1)
    cw = {0: 0.5, 1: 2.0, 2: 1.0}

    def build() -> Any:
        keras.utils.set_random_seed(4)
        return keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(10, activation="relu"), keras.layers.Dense(CLASSES)]
        )

    model, twin = build(), build()
    twin.set_weights(model.get_weights())
    model.compile(
        keras.optimizers.SGD(LR),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    labels = y[:, None] if labels_2d else y
    sink = fit(model, x, labels, class_weight=cw)
    weights = np.array([cw[int(c)] for c in y], dtype="float32")

    def losses(yb: Any, pred: Any, w: Any) -> dict[str, Any]:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(yb, pred, sample_weight=w)
        return {"loss": loss, "accuracy": batch_accuracy(yb, pred)}

    return {**sink.result(), "truth": tape_truth(twin, x, labels, losses, sample_weight=weights)}


def embedding() -> dict[str, Any]:
    """Token ids with many repeats in a batch: the Embedding's gradient is IndexedSlices."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 7, size=(BATCH * BATCHES, 10))  # 160 tokens from 7 ids per batch
    y = rng.integers(0, 2, size=(BATCH * BATCHES,))

    def build() -> Any:
        keras.utils.set_random_seed(5)
        return keras.Sequential(
            [
                keras.Input((10,), dtype="int32"),
                keras.layers.Embedding(7, 4),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(2),
            ]
        )

    model, twin = build(), build()
    twin.set_weights(model.get_weights())
    fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(LR), loss=fn)
    sink = fit(model, x, y)
    return {**sink.result(), "truth": tape_truth(twin, x, y, lambda yb, p, w: {"loss": fn(yb, p)})}


def loss_scale_first_step() -> dict[str, Any]:
    """mixed_float16's LossScaleOptimizer whose first steps overflow (a huge initial scale)."""
    x, y = data(3)
    x = x * 100.0  # gradients above 2: scaled by 2**127 they overflow float32, and the step is skipped
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(CLASSES)]
    )
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(LR), initial_scale=2.0**127)
    model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    sink = fit(model, x, y)
    return sink.result()


def nan_gradient(k: int) -> dict[str, Any]:
    """A finite loss with NaN gradients at batch k (|h| = sqrt(h^2) at h == 0 has a 0/0 derivative):
    the weights turn NaN there."""
    x, y = data(4)
    x[k * BATCH] = 0.0  # with no bias, this sample's hidden units are exactly 0
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, use_bias=False),
            keras.layers.Lambda(lambda h: keras.ops.sqrt(keras.ops.square(h))),
            keras.layers.Dense(CLASSES),
        ]
    )
    model.compile(keras.optimizers.SGD(LR), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    sink = fit(model, x, y)
    return {**sink.result(), "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations))}


class LowerLevel(keras.Model):
    """keras.io "going lower-level": its own loss function, tracker and optimizer call."""

    def __init__(self, *args: Any, tracker: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_fn = keras.losses.MeanSquaredError()
        self.with_tracker = tracker
        # with no loss tracker, a metric of another name (Keras needs a non-empty result)
        self.loss_tracker = keras.metrics.Mean(name="loss") if tracker else keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data: Any) -> Any:
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        if self.with_tracker:
            self.loss_tracker.update_state(loss)
        else:
            self.loss_tracker.update_state(y, y_pred)
        return {self.loss_tracker.name: self.loss_tracker.result()}

    @property
    def metrics(self) -> list[Any]:
        return [self.loss_tracker]


def lower_level(tracker: bool) -> dict[str, Any]:
    x, _ = data(5)
    y = x[:, :1] * 3.0
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs))
    keras.utils.set_random_seed(6)
    model = LowerLevel(inputs, outputs, tracker=tracker)
    twin = keras.Model(inputs, outputs)  # the same layers: rebuilt below with the same weights
    weights = model.get_weights()
    model.compile(keras.optimizers.SGD(LR))
    sink = fit(model, x, y)
    twin.set_weights(weights)
    fn = keras.losses.MeanSquaredError()
    return {**sink.result(), "truth": tape_truth(twin, x, y, lambda yb, p, w: {"loss": fn(yb, p)})}


def any_tap() -> dict[str, Any]:
    """BatchtapCallback(bt.Tap()) with the default metrics, on this backend."""
    x, labels = data(6)
    y = keras.utils.to_categorical(labels, CLASSES)  # one-hot: mae compares rows of the outputs' shape
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES, activation="softmax")])
    model.compile("sgd", loss="categorical_crossentropy", metrics=["accuracy", "mae"], jit_compile=False)
    sink = Keep()
    tap = bt.Tap(sinks=[sink], flush_every=5)
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        verbose=0,
        validation_data=(x[:32], y[:32]),
        callbacks=[BatchtapCallback(tap)],
    )
    tap.close()
    return sink.result()


def tf_capture() -> dict[str, Any]:
    """A plain TensorFlow loop with TFCapture: loss-only steps, two epochs, AutoGraph quiet."""
    import tensorflow as tf

    sink = Keep()
    tap = bt.Tap(sinks=[sink], flush_every=3, flush_seconds=1e6)
    cap = TFCapture(tap)
    w = tf.Variable(2.0)
    losses: list[float] = []

    @tf.function
    def train_step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.square(w * x - 1.0)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        cap.step(loss)
        return loss

    captured = io.StringIO()
    handler = logging.StreamHandler(captured)
    tf_logger = tf.get_logger()
    tf_logger.addHandler(handler)
    try:
        with tap.run(name="tfcapture"):
            for epoch in range(2):
                cap.new_epoch(epoch)
                for i in range(5):
                    losses.append(float(train_step(tf.constant(0.5 + 0.1 * i))))
                    cap.advance()
            cap.flush()
    finally:
        tf_logger.removeHandler(handler)
    tap.close()
    return {**sink.result(), "losses": losses, "tf_log": captured.getvalue()}


def overrun() -> dict[str, Any]:
    """TFCapture whose host never calls advance(): the ring (capacity 2 * (2 + 1) = 6) is
    overwritten; the flush takes the newest rows, in step order, once each."""
    import tensorflow as tf

    sink = Keep()
    tap = bt.Tap(sinks=[sink], flush_every=2, flush_seconds=1e6)
    cap = TFCapture(tap)
    counter = tf.Variable(0.0)

    @tf.function
    def train_step() -> None:
        counter.assign_add(1.0)
        cap.step(counter.read_value())  # the loss is the step's number, from 1

    with tap.run(name="overrun"):
        for _ in range(20):
            train_step()
        taken = cap.flush()
    tap.close()
    return {**sink.result(), "taken": taken, "capacity": cap.capacity}


def process_pipeline() -> dict[str, Any]:
    """The dict two-output fit with ``bt.Tap(pipeline="process")``: the values stored (SQLite,
    written by the pipeline process) and which frameworks that process had loaded at each call."""
    import sqlite3
    import tempfile

    from tests.pipeline.probe_sinks import ModulesSink, notes

    folder = tempfile.mkdtemp(prefix="batchtap-keras-")
    db, path = os.path.join(folder, "store.db"), os.path.join(folder, "modules.jsonl")
    tap = bt.Tap(
        sinks=[bt.sinks.SQLite(db), ModulesSink(path, modules=("torch", "tensorflow"))],
        flush_every=5,
        flush_seconds=1e6,
        pipeline="process",
    )
    case = two_heads("dict", tap)
    rows: dict[int, dict[str, Any]] = {}
    with sqlite3.connect(db) as conn:
        for metric, step, epoch, batch, value in conn.execute("SELECT metric, step, epoch, batch, value FROM metrics"):
            rows.setdefault(step, {"step": step, "epoch": epoch, "batch": batch})[metric] = value
        status, reason = conn.execute("SELECT status, stop_reason FROM runs").fetchone()
    return {
        "rows": [rows[k] for k in sorted(rows)],
        "truth": case["truth"],
        "status": status,
        "reason": reason,
        "notes": notes(path),
        "pid": os.getpid(),
    }


def planted_accuracy() -> dict[str, Any]:
    """Torch backend: the dict two-output fit with a planted wrong count in ``accuracy/head_a`` at
    its third step (twice as many hits as targets): an accuracy outside [0, 1], which the run must
    report as an anomaly (a plain extra would be stored as it is)."""
    from batchtap.integrations import _keras_accuracy

    original = _keras_accuracy.HeadAccuracy.compute
    calls = [0]

    def compute(self: Any, inputs: Any) -> Any:
        hits, counted = original(self, inputs)
        calls[0] += 1
        return (counted * 2.0, counted) if calls[0] == 3 else (hits, counted)

    _keras_accuracy.HeadAccuracy.compute = compute  # type: ignore[method-assign]
    try:
        return two_heads("dict")
    finally:
        _keras_accuracy.HeadAccuracy.compute = original  # type: ignore[method-assign]


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "dict": lambda: two_heads("dict"),
    "list": lambda: two_heads("list"),
    "class_weight": lambda: class_weights(False),
    "labels_n1": lambda: class_weights(True),
    "embedding": embedding,
    "loss_scale": loss_scale_first_step,
    "nan_grad": lambda: nan_gradient(3),
    "lower_level": lambda: lower_level(True),
    "no_loss": lambda: lower_level(False),
    "any_tap": any_tap,
    "tf_capture": tf_capture,
    "overrun": overrun,
    "process_pipeline": process_pipeline,
    "planted_accuracy": planted_accuracy,
}


#: cases that test the torch backend only (left out of a run of every case, which is TensorFlow's)
TORCH_ONLY = frozenset({"planted_accuracy"})


def main() -> None:
    names = sys.argv[2:] or [n for n in CASES if n not in TORCH_ONLY]
    out: dict[str, Any] = {"backend": BACKEND}
    for name in names:
        out[name] = CASES[name]()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
