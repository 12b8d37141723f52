"""Keras columns of the conformance matrix: ``BatchtapCallback`` on TensorFlow (XLA off and on) and on
the torch backend, and ``TFCapture`` in a plain ``tf.function`` loop.

Each cell trains in a subprocess (Keras picks its backend once per process, and the test process
never imports TensorFlow): this file run as a script, ``python keras_cells.py FRONTEND SCENARIO
WORKDIR``. The run stores into ``WORKDIR/store.db``; the truth is written beside it: for the Keras
front-ends an independent float64 numpy computation of the same training (the per-batch loss,
accuracy, gradient norm and the schedule's rate), for ``TFCapture`` the values the loop's own
train step returns, read on the host (``.numpy()``) in the same run.

Only the ``plain`` scenario applies to Keras (the other scenarios are PyTorch loops: accumulation,
``clip_grad_norm_``, GradScaler, padding, process groups); ``keras-two-outputs`` is Keras' own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]

FEATURES, HIDDEN, CLASSES, BATCH, BATCHES, EPOCHS = 8, 16, 3, 16, 8, 2
LR0, DECAY_RATE, DECAY_STEPS = 0.1, 0.9, 10.0

#: front-end -> (KERAS_BACKEND, jit_compile)
_SETTINGS = {
    "keras-tf": ("tensorflow", False),
    "keras-tf-xla": ("tensorflow", True),
    "keras-torch": ("torch", False),
    "tfcapture": ("tensorflow", False),
}


def _cell(frontend: str) -> Callable[[str, Path], Any]:
    def run(scenario: str, workdir: Path) -> Any:
        import pytest

        from tests.conformance.compare import Outcome

        backend = _SETTINGS[frontend][0]
        for module in ("keras", backend if backend == "tensorflow" else "torch"):
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"needs batchtap[keras] ({module})")
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run(
            [sys.executable, str(HERE), frontend, scenario, str(workdir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        steps = json.loads((workdir / "truth.json").read_text())
        # fit() front-ends time every call (TensorFlow) or step (torch); a plain TFCapture loop that
        # never calls call_started() has no step time
        return Outcome(steps=steps, reads=None, db=workdir / "store.db", step_time=frontend != "tfcapture")

    return run


def _entries() -> tuple[list[Any], list[Any], dict[tuple[str, str], Any]]:
    from tests.conformance.registry import NA, SCENARIOS, FrontEnd, Scenario

    frontends = [
        FrontEnd("keras-tf", _cell("keras-tf"), "BatchtapCallback, Keras 3 fit() on TensorFlow"),
        FrontEnd("keras-tf-xla", _cell("keras-tf-xla"), "BatchtapCallback, fit() on TensorFlow, jit_compile=True"),
        FrontEnd("keras-torch", _cell("keras-torch"), "BatchtapCallback, Keras 3 fit() on the torch backend"),
        FrontEnd("tfcapture", _cell("tfcapture"), "TFCapture in a plain tf.function loop"),
    ]
    scenarios = [
        Scenario(
            "keras-two-outputs",
            "a Keras model with a classifier and a regression output (a dict), loss weights 1 and 0.5: "
            "loss (Keras' total), loss/<output>, accuracy/<output>",
        )
    ]
    pytorch_only = NA("a PyTorch loop's scenario: Keras and TFCapture steps have no such form")
    marks: dict[tuple[str, str], Any] = {}
    for scenario in SCENARIOS:
        if scenario.name != "plain":
            for frontend in frontends:
                marks[(scenario.name, frontend.name)] = pytorch_only
    for name in ("explicit", "autolog", "run", "lightning", "hf", "accelerate"):
        marks[("keras-two-outputs", name)] = NA("a Keras model's scenario")
    marks[("keras-two-outputs", "tfcapture")] = NA("TFCapture is handed one loss and one output by the loop")
    return frontends, scenarios, marks


FRONTENDS, SCENARIOS, MARKS = _entries() if __name__ != "__main__" else ([], [], {})


# ---------------------------------------------------------------------- the subprocess


def _data() -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * BATCHES, FEATURES)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(BATCH * BATCHES,))


def _weights() -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(1)
    return [
        (rng.normal(size=(FEATURES, HIDDEN)) * 0.4).astype("float32"),
        (rng.normal(size=(HIDDEN,)) * 0.1).astype("float32"),
        (rng.normal(size=(HIDDEN, CLASSES)) * 0.4).astype("float32"),
        (rng.normal(size=(CLASSES,)) * 0.1).astype("float32"),
    ]


def _numpy_truth(x: Any, y: Any, target_b: Any = None) -> list[dict[str, float]]:
    """The same training in float64 numpy (an MLP, softmax CE, SGD under ExponentialDecay); with
    ``target_b`` a second, linear head on the hidden layer (MSE, loss weight 0.5)."""
    import numpy as np

    w1, b1, w2, b2 = (a.astype(np.float64) for a in _weights())
    rng = np.random.default_rng(2)
    v, c = (rng.normal(size=(HIDDEN, 1)) * 0.3), np.zeros(1)
    rows = []
    for k in range(BATCHES * EPOCHS):
        i = (k % BATCHES) * BATCH
        xb, yb = x[i : i + BATCH].astype(np.float64), y[i : i + BATCH]
        z1 = xb @ w1 + b1
        h = np.maximum(z1, 0)
        logits = h @ w2 + b2
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ce = float(-np.log(p[np.arange(BATCH), yb]).mean())
        d = p.copy()
        d[np.arange(BATCH), yb] -= 1
        d /= BATCH
        gw2, gb2 = h.T @ d, d.sum(0)
        dh = d @ w2.T
        row = {"epoch": k // BATCHES, "batch": k % BATCHES, "accuracy": float((p.argmax(1) == yb).mean())}
        grads = [gw2, gb2]
        if target_b is None:
            row["loss"] = ce
        else:
            out = h @ v + c
            err = out - target_b[i : i + BATCH].astype(np.float64)
            mse = float((err**2).mean())
            row.update(
                {"loss": ce + 0.5 * mse, "loss/head_a": ce, "loss/head_b": mse, "accuracy/head_a": row["accuracy"]}
            )
            del row["accuracy"]
            dout = 0.5 * 2 * err / BATCH
            gv, gc = h.T @ dout, dout.sum(0)
            dh = dh + dout @ v.T
            grads += [gv, gc]
        dh = dh * (z1 > 0)
        gw1, gb1 = xb.T @ dh, dh.sum(0)
        grads += [gw1, gb1]
        lr = LR0 * DECAY_RATE ** (k / DECAY_STEPS)
        row["lr"] = lr
        row["grad_norm"] = float(np.sqrt(sum((g**2).sum() for g in grads)))
        rows.append(row)
        w1, b1, w2, b2 = w1 - lr * gw1, b1 - lr * gb1, w2 - lr * gw2, b2 - lr * gb2
        if target_b is not None:
            v, c = v - lr * gv, c - lr * gc
    return rows


def _keras_fit(scenario: str, workdir: Path, jit: bool) -> list[dict[str, float]]:
    import keras
    import numpy as np

    import batchtap as bt
    from batchtap.integrations.keras import BatchtapCallback

    x, y = _data()
    inp = keras.Input((FEATURES,))
    h = keras.layers.Dense(HIDDEN, activation="relu")(inp)
    a = keras.layers.Dense(CLASSES, activation="softmax", name="head_a")(h)
    schedule = keras.optimizers.schedules.ExponentialDecay(LR0, decay_steps=DECAY_STEPS, decay_rate=DECAY_RATE)
    target_b = None
    if scenario == "keras-two-outputs":
        b = keras.layers.Dense(1, name="head_b")(h)
        model = keras.Model(inp, {"head_a": a, "head_b": b})
        rng = np.random.default_rng(2)
        model.set_weights([*_weights(), (rng.normal(size=(HIDDEN, 1)) * 0.3).astype("float32"), np.zeros(1, "float32")])
        target_b = (x[:, :1] * 2.0).astype("float32")
        model.compile(
            keras.optimizers.SGD(schedule),
            loss={"head_a": "sparse_categorical_crossentropy", "head_b": "mse"},
            loss_weights={"head_a": 1.0, "head_b": 0.5},
            jit_compile=jit,
        )
        targets: Any = {"head_a": y, "head_b": target_b}
    else:
        model = keras.Model(inp, a)
        model.set_weights(_weights())
        model.compile(keras.optimizers.SGD(schedule), loss="sparse_categorical_crossentropy", jit_compile=jit)
        targets = y
    tap = bt.Tap(sinks=[bt.sinks.SQLite(str(workdir / "store.db"))], flush_every=5)
    model.fit(x, targets, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[BatchtapCallback(tap)])
    tap.close()
    return _numpy_truth(x, y, target_b)


def _tfcapture(workdir: Path) -> list[dict[str, float]]:
    import keras
    import tensorflow as tf

    import batchtap as bt
    from batchtap.integrations.keras import TFCapture

    x, y = _data()
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu"), keras.layers.Dense(CLASSES)]
    )
    model.set_weights(_weights())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(LR0)
    optimizer.build(model.trainable_variables)
    tap = bt.Tap(sinks=[bt.sinks.SQLite(str(workdir / "store.db"))], flush_every=5)
    cap = TFCapture(tap)

    @tf.function
    def train_step(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = loss_fn(yb, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        norm = tf.linalg.global_norm(grads)
        lr = optimizer.learning_rate
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1), tf.cast(yb, tf.int64)), tf.float32))
        cap.step(loss, outputs=logits, targets=yb, grad_norm=norm, lr=lr)
        return loss, accuracy, norm, lr

    truth = []
    with tap.run(name="tfcapture"):
        for epoch in range(EPOCHS):
            cap.new_epoch(epoch)
            for batch in range(BATCHES):
                i = batch * BATCH
                values = train_step(tf.constant(x[i : i + BATCH]), tf.constant(y[i : i + BATCH]))
                loss, accuracy, norm, lr = (float(v.numpy()) for v in values)  # the loop's own host read
                truth.append(
                    {"epoch": epoch, "batch": batch, "loss": loss, "accuracy": accuracy, "grad_norm": norm, "lr": lr}
                )
                cap.advance()
        cap.flush()
    tap.close()
    return truth


def main() -> None:
    frontend, scenario, workdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    sys.path.insert(0, str(ROOT / "src"))
    if frontend == "tfcapture":
        truth = _tfcapture(workdir)
    else:
        truth = _keras_fit(scenario, workdir, jit=_SETTINGS[frontend][1])
    truth = [{**row, "samples": float(BATCH)} for row in truth]  # every batch full: what throughput counts
    (workdir / "truth.json").write_text(json.dumps(truth))


if __name__ == "__main__":
    main()
