"""Keras ``fit()`` time per step: without batchtap, with ``BatchtapCallback``, and with the common
per-batch recipe (a callback doing ``float(logs["loss"])`` in ``on_train_batch_end``), side by side.

Models: ``--model convnet`` (default: the keras.io MNIST convnet, on random 28x28x1 images, batch
128) or ``--model mlp`` (a tiny MLP, ~1 ms steps). Each variant runs ``--epochs`` epochs; the first
epoch (tracing, compilation) is left out and the step time is the median over the remaining epochs
of (epoch time / batches). Variants alternate (plain, batchtap, float(loss), plain, ...) for
``--repeats`` rounds and the medians are reported. One backend per process (Keras picks it once).
``--matrix`` runs every TensorFlow setting the goal names in one process: XLA off and on, times
``steps_per_execution`` 1 and 8 (one table each).

    KERAS_BACKEND=tensorflow .venv/bin/python bench/keras_fit.py --matrix
    KERAS_BACKEND=tensorflow .venv/bin/python bench/keras_fit.py --jit --steps-per-execution 8
    KERAS_BACKEND=torch .venv/bin/python bench/keras_fit.py

``--compiled-step N`` (TensorFlow) times only the compiled train step (``model.train_step`` in a
``tf.function``), called N times in a tight loop on one fixed batch, without and with the hooks
``BatchtapCallback`` adds (NaN freeze and ring row included): the in-graph cost without ``fit()``'s
per-step host work, which on a shared machine drowns it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import batchtap as bt  # noqa: E402
from batchtap.integrations.keras import BatchtapCallback  # noqa: E402


class EpochClock(keras.callbacks.Callback):  # type: ignore[misc]
    """Host time of each epoch (epoch hooks only: no per-batch hook, so it adds no read)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._start = 0.0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seconds.append(time.perf_counter() - self._start)


class FloatLoss(keras.callbacks.Callback):  # type: ignore[misc]
    """The per-batch recipe: read the loss on the host every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.losses.append(float(logs["loss"]))


def make_model(kind: str, shape: tuple[int, ...]) -> Any:
    if kind == "convnet":  # keras.io/examples/vision/mnist_convnet
        return keras.Sequential(
            [
                keras.Input(shape),
                keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
                keras.layers.MaxPooling2D(pool_size=(2, 2)),
                keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
                keras.layers.MaxPooling2D(pool_size=(2, 2)),
                keras.layers.Flatten(),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
    return keras.Sequential(
        [keras.Input(shape), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10, activation="softmax")]
    )


def fit_once(variant: str, x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> float:
    model = make_model(args.model, x.shape[1:])
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss="sparse_categorical_crossentropy",
        jit_compile=args.jit,
        steps_per_execution=args.steps_per_execution,
    )
    clock = EpochClock()
    callbacks: list[Any] = [clock]
    tap = None
    if variant == "batchtap":
        tap = bt.Tap(sinks=[], flush_every=50)
        callbacks.append(BatchtapCallback(tap))
    elif variant == "float(loss)":
        callbacks.append(FloatLoss())
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks)
    if tap is not None:
        tap.close()
    batches = len(x) // args.batch_size
    return statistics.median(clock.seconds[1:]) / batches


def compiled_step_once(variant: str, x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> float:
    """Seconds per call of a tf.function train step (the Keras hooks in it for ``batchtap``)."""
    import tensorflow as tf

    from batchtap.integrations._keras_tf import TFRecorder

    model = make_model(args.model, x.shape[1:])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    xb, yb = tf.constant(x[: args.batch_size]), tf.constant(y[: args.batch_size])
    recorder = None
    if variant == "batchtap":
        tap = bt.Tap(sinks=[], flush_every=50)
        recorder = TFRecorder(model, tap, flush_every=None, freeze_on_nan=True)

    @tf.function(jit_compile=args.jit)
    def step(xs: Any, ys: Any) -> None:
        model.train_step((xs, ys))

    for _ in range(50):
        step(xb, yb)
    start = time.perf_counter()
    for _ in range(args.compiled_step):
        step(xb, yb)
    seconds = (time.perf_counter() - start) / args.compiled_step
    if recorder is not None:
        recorder.remove()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=None, help="default: 128 (convnet), 32 (mlp)")
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--compiled-step", type=int, default=0, help="time N calls of the compiled step only")
    parser.add_argument("--model", choices=("convnet", "mlp"), default="convnet")
    parser.add_argument("--matrix", action="store_true", help="XLA off/on x steps_per_execution 1/8 (TensorFlow)")
    args = parser.parse_args()
    if args.batch_size is None:
        args.batch_size = 128 if args.model == "convnet" else 32
    rng = np.random.default_rng(0)
    shape = (28, 28, 1) if args.model == "convnet" else (32,)
    x = rng.uniform(size=(args.batches * args.batch_size, *shape)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    settings = [(False, 1), (False, 8), (True, 1), (True, 8)] if args.matrix else [(args.jit, args.steps_per_execution)]
    print(f"load average at start: {os.getloadavg()}")
    for jit, spe in settings:
        args.jit, args.steps_per_execution = jit, spe
        table(x, y, args)


def table(x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> None:
    variants: tuple[str, ...] = ("plain", "batchtap", "float(loss)")
    run_once = fit_once
    what = f"steps_per_execution={args.steps_per_execution}, {args.batches} batches of {args.batch_size}, "
    what += f"median of {args.repeats} interleaved rounds (epochs 2-{args.epochs})"
    if args.compiled_step:
        variants, run_once = ("plain", "batchtap"), compiled_step_once
        what = f"compiled step only, {args.compiled_step} calls per round, median of {args.repeats} interleaved rounds"
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for variant in variants:
            times[variant].append(run_once(variant, x, y, args))
    base = statistics.median(times["plain"])
    print(
        f"\nkeras {keras.__version__}, backend {keras.backend.backend()}, {args.model}, jit_compile={args.jit}, {what}"
    )
    print("| variant | us per step (median) | vs plain | runs (us) |")
    print("|---|---|---|---|")
    for variant in variants:
        med = statistics.median(times[variant])
        runs = ", ".join(f"{t * 1e6:.0f}" for t in times[variant])
        print(f"| {variant} | {med * 1e6:.0f} | {med / base:.3f}x | {runs} |")


if __name__ == "__main__":
    main()
