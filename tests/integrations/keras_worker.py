"""Runs Keras fits with BatchtapCallback on ONE backend (set by KERAS_BACKEND) and writes what was
stored next to an independent float64 numpy reference of the same training, as JSON.

Used by tests/integrations/test_keras.py in a subprocess, so the test process never imports
TensorFlow (and both backends can be tested: Keras picks its backend once per process).

    KERAS_BACKEND=tensorflow python tests/integrations/keras_worker.py out.json
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import batchtap as bt  # noqa: E402
from batchtap.integrations.keras import BatchtapCallback  # noqa: E402
from batchtap.sinks.base import Sink  # noqa: E402

BACKEND = keras.backend.backend()
FEATURES, HIDDEN, CLASSES, BATCH, BATCHES, EPOCHS = 8, 16, 3, 16, 32, 2
LR0, DECAY_RATE, DECAY_STEPS = 0.1, 0.9, 10.0


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


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH * BATCHES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(BATCH * BATCHES,))
    w = rng.uniform(0.2, 2.0, size=(BATCH * BATCHES,)).astype("float32")
    return x, y, w


def init_weights(seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(FEATURES, HIDDEN)) * 0.4).astype("float32"),
        (rng.normal(size=(HIDDEN,)) * 0.1).astype("float32"),
        (rng.normal(size=(HIDDEN, CLASSES)) * 0.4).astype("float32"),
        (rng.normal(size=(CLASSES,)) * 0.1).astype("float32"),
    ]


def reference(x: np.ndarray, y: np.ndarray, w: np.ndarray | None, steps: int) -> list[dict[str, float]]:
    """The same training in float64 numpy: per step the batch's loss, accuracy, lr, grad norm."""
    w1, b1, w2, b2 = (a.astype(np.float64) for a in init_weights())
    rows = []
    for k in range(steps):
        i = (k % BATCHES) * BATCH
        xb, yb = x[i : i + BATCH].astype(np.float64), y[i : i + BATCH]
        wb = np.ones(BATCH) if w is None else w[i : i + BATCH].astype(np.float64)
        z1 = xb @ w1 + b1
        h = np.maximum(z1, 0)
        logits = h @ w2 + b2
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ce = -np.log(p[np.arange(BATCH), yb])
        loss = float((ce * wb).sum() / BATCH)  # Keras' "sum_over_batch_size" reduction
        d = p.copy()
        d[np.arange(BATCH), yb] -= 1
        d *= (wb / BATCH)[:, None]
        gw2, gb2 = h.T @ d, d.sum(0)
        dh = (d @ w2.T) * (z1 > 0)
        gw1, gb1 = xb.T @ dh, dh.sum(0)
        norm = float(np.sqrt(sum((g**2).sum() for g in (gw1, gb1, gw2, gb2))))
        lr = LR0 * DECAY_RATE ** (k / DECAY_STEPS)
        acc = float((p.argmax(1) == yb).mean())
        rows.append({"loss": loss, "accuracy": acc, "lr": lr, "grad_norm": norm})
        w1, b1, w2, b2 = w1 - lr * gw1, b1 - lr * gb1, w2 - lr * gw2, b2 - lr * gb2
    return rows


def make_model(*, jit: bool, spe: int, onehot: bool, loss_scale: bool = False) -> Any:
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.set_weights(init_weights())
    schedule = keras.optimizers.schedules.ExponentialDecay(LR0, decay_steps=DECAY_STEPS, decay_rate=DECAY_RATE)
    optimizer: Any = keras.optimizers.SGD(schedule)
    if loss_scale:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=1024.0)
    model.compile(
        optimizer=optimizer,
        loss="categorical_crossentropy" if onehot else "sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=jit,
        steps_per_execution=spe,
    )
    return model


def new_tap(sink: Sink, flush_every: int = 10) -> bt.Tap:
    metrics = [bt.metrics.Loss()] if BACKEND == "tensorflow" else None
    return bt.Tap(metrics=metrics, sinks=[sink], flush_every=flush_every, flush_seconds=1e6)


def exact(jit: bool, spe: int, onehot: bool, weighted: bool, loss_scale: bool) -> dict[str, Any]:
    x, y, w = data()
    model = make_model(jit=jit, spe=spe, onehot=onehot, loss_scale=loss_scale)
    sink = Keep()
    tap = new_tap(sink)
    targets = keras.utils.to_categorical(y, CLASSES) if onehot else y
    model.fit(
        x, targets, sample_weight=w if weighted else None, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
        callbacks=[BatchtapCallback(tap, name="exact")], validation_data=(x[:32], targets[:32]),
    )  # fmt: skip
    tap.close()
    rows = [
        {"step": r.step, "epoch": r.epoch, "batch": r.batch, **r.values} for r in sink.records if "loss" in r.values
    ]
    logged = [r.values for r in sink.records if "loss" not in r.values]
    logged_at = [(r.epoch, r.step) for r in sink.records if "loss" not in r.values]
    return {
        "rows": rows,
        "logged": logged,
        "logged_at": logged_at,
        "reference": reference(x, y, w if weighted else None, BATCHES * EPOCHS),
        "status": sink.ended[0].status.value,
    }


def nan_stop(k: int, jit: bool, spe: int) -> dict[str, Any]:
    x, y, w = data()
    w = w.copy()
    w[k * BATCH] = np.nan  # batch k's loss is NaN (a NaN input can vanish in a relu)
    model = make_model(jit=jit, spe=spe, onehot=False)
    sink = Keep()
    tap = new_tap(sink)
    model.fit(
        x,
        y,
        sample_weight=w,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[BatchtapCallback(tap)],
    )
    tap.close()
    steps = [r.step for r in sink.records if "loss" in r.values]
    return {
        "steps": steps,
        "status": sink.ended[0].status.value,
        "reason": sink.ended[0].stop_reason,
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
    }


class ReadCount:
    """Counts host reads in this thread: TensorFlow's EagerTensor._numpy, keras.ops.convert_to_numpy,
    and (torch backend) batchtap's HostReadCounter over torch's read paths."""

    def __init__(self) -> None:
        self.count = 0
        self._thread = threading.get_ident()
        self._undo: list[Any] = []
        self._torch: Any = None

    def _patch(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                self.count += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._undo.append((owner, name, original))

    def __enter__(self) -> ReadCount:
        self._patch(keras.ops, "convert_to_numpy")
        if BACKEND == "tensorflow":
            from tensorflow.python.framework import ops as tf_ops

            self._patch(tf_ops._EagerTensorBase, "_numpy")
        else:
            from batchtap.hostreads import HostReadCounter

            self._torch = HostReadCounter().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        if self._torch is not None:
            self._torch.__exit__(*exc)
            self.count += self._torch.count


def reads(jit: bool, spe: int) -> dict[str, Any]:
    x, y, _ = data()
    counts = {}
    batchtap_reads = 0
    for with_tap in (False, True, False, True):  # twice each: the second of each is compared
        model = make_model(jit=jit, spe=spe, onehot=False)
        callbacks: list[Any] = []
        tap = None
        if with_tap:
            tap = new_tap(Keep(), flush_every=16)
            callbacks = [BatchtapCallback(tap)]
        with ReadCount() as counter:
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
        if tap is not None:
            tap.close()
            batchtap_reads = callbacks[0].host_reads
        counts["with" if with_tap else "without"] = counter.count
    return {**counts, "batchtap_reads": batchtap_reads, "steps": BATCHES * EPOCHS}


def main() -> None:
    out: dict[str, Any] = {"backend": BACKEND, "keras": keras.__version__}
    spes = (1, 10) if BACKEND == "tensorflow" else (1,)  # the torch backend allows 1 only
    for jit in (False, True):
        for spe in spes:
            out[f"exact-jit{int(jit)}-spe{spe}"] = exact(jit, spe, onehot=False, weighted=False, loss_scale=False)
            out[f"nan-jit{int(jit)}-spe{spe}"] = nan_stop(20, jit, spe)
    out["exact-onehot-weighted"] = exact(False, 1, onehot=True, weighted=True, loss_scale=False)
    out["exact-lossscale"] = exact(False, spes[-1], onehot=False, weighted=False, loss_scale=True)
    out["reads-jit0"] = reads(False, spes[-1])
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
