"""Keras ``fit()`` time per step without and with ``BatchtapCallback`` (and, with ``--float-loss``,
with the common per-batch recipe: a callback doing ``float(logs["loss"])`` in
``on_train_batch_end``): the ratio the Keras issue's goal is about (``fit()`` with the callback
<= 1.02x plain ``fit()``), decided by paired rounds.

Model: ``--model convnet`` (default: the keras.io MNIST convnet, on random 28x28x1 images, batch
128) or ``--model mlp`` (a tiny MLP, ~1 ms steps). One backend per process (Keras picks it once).

How a setting is measured (one ``jit_compile`` x ``steps_per_execution``; ``--matrix`` runs the
four the goal names, XLA off/on x 1/8, in one process):

* TensorFlow's thread pools are fixed before anything runs (``--threads``: intra-op, inter-op;
  default ``<cores>,1``), identically for every variant, and printed (torch: ``torch.set_num_threads``).
* Each variant has its own model, made and compiled once per setting with the same initial
  weights. A round runs ``fit(epochs=1 + --epochs)`` of each variant in turn, the order reversed
  every other round (ABBA), so a drift of the machine's load falls on both. The first epoch of
  every ``fit`` is left out: it holds the tracing and (XLA) compilation, which batchtap repeats
  at every ``fit`` (its hooks are traced in, and out again at the end).
* An epoch's time is taken between consecutive ``on_epoch_end`` hooks by a clock that is the
  last callback, so batchtap's own epoch-boundary work (the ring flush) is inside it. Per round
  and variant: the median over the timed epochs of (epoch time / batches).
* Process CPU time (all threads) per step is printed beside the wall time: on a loaded machine
  it moves far less than wall time, though the goal is about wall time.
* The ratio is the **median of the paired per-round ratios** (variant / plain of the same round);
  their quartiles and range are printed, and the verdict: ``met`` when the upper quartile of the
  paired ratios is <= the goal, ``missed`` when the lower quartile is above it, else
  ``undecided`` (fewer than 5 rounds, quartiles more than twice the margin apart — 0.04 for
  1.02x, a machine too noisy to tell — or straddling the goal: rerun with more ``--rounds`` on a
  quieter machine).
* **The A/A control** (``plain (again)``, leave it out with ``--no-control``): plain ``fit()`` of a
  third model, its train function traced again at every ``fit`` as the callback's is, paired with
  plain like batchtap. Its paired ratios are what the machine (and a fresh trace) does to two
  identical variants: where their quartiles are more than twice the margin apart, the verdict is
  ``undecided (plain vs plain again ...)`` whatever batchtap's ratios say. Beside it, per variant:
  the **low-quartile ratio** (the lower quartile of all its timed epochs over plain's: load only
  ever adds time, so the fast epochs are the least disturbed), the **slow rounds** (rounds more
  than 1.15x the variant's fastest: the slow mode, counted for every variant, plain included),
  the **training thread's CPU** per step and the **pipeline thread's wake-ups** per epoch
  (``/proc``, Linux; 0 for the variants without batchtap).

What the 1.4x "slow rounds" at ``steps_per_execution=1`` were (third session's matrix, "undecided"
there), measured with this bench and per-thread counters on the 2-core machine while other jobs ran
(load average 3-7, so no wall figure here is a quiet one; all side by side in one process):

* **plain ``fit()`` has them too.** The A/A pair spreads as widely as batchtap / plain: paired per
  round, plain (again) / plain 0.858x [0.693-1.173] (0.599-1.724) beside batchtap / plain 0.902x
  [0.775-0.975] (0.648-1.496); slow rounds plain 4/7, plain (again) 4/7, batchtap 5/7 (convnet,
  XLA off, spe 1, load 3.4-5.7). Process CPU per step: batchtap 1.001x, plain (again) 0.986x. The
  earlier matrix had no control, so slow rounds of the batchtap variant read as batchtap's. Under
  XLA (spe 1, 5 rounds, load 2.5-3.6) plain's own rounds ran from 92 to 580 ms a step with the
  same CPU time: plain (again) / plain 1.505x [0.642-1.651] (0.487-3.389), batchtap / plain
  1.443x [0.539-1.904] (0.430-1.977), process CPU 1.028x and 0.994x.
* **batchtap's pipeline thread does not wake while steps run.** Its loop blocks on its queue (no
  timer): ~5 voluntary context switches per 64-step epoch, for the 2 blocks an epoch hands over
  (the flush at step 50, the epoch-end flush; the messages it handled, counted: nothing else), and
  ~0.28 ms of CPU per block (max 0.57 ms): < 15 us per step, the most it can hold the GIL from the
  training thread (below ``sys.getswitchinterval()``'s 5 ms, so switching faster cannot help; at most
  ~3 ms an epoch, 0.2 %).
* **What batchtap adds per step, measured:** on the training thread, the train-function wrapper's
  host clock and ``advance()`` (~1 us in a tight loop, ~10 us between TensorFlow calls) and the
  flush amortized (~0.47 ms per flush of 50 rows: ~10 us a step). In the graph, ~40 small ops (the
  row, the counter, accuracy, the norm, the NaN freeze's ``tf.cond``). Per call of Keras' own
  train function (``--calls 1000 --rounds 16 --model mlp``, load 2.3-3.4, A/A control within
  +-30 us): **+211 us of process CPU, +225 us wall** beside plain, of which ~140 us was the
  ``samples`` column: ``tf.shape`` of the softmax output kept the softmax op alive (Keras computes
  the loss from its logits, so plain ``fit()`` prunes it) wherever the batch dimension is unknown
  while tracing, as in ``fit()`` (a fixed batch folds the shape: ``--compiled-step`` showed ~+40
  us). Taken from the logits now (as accuracy already was; a sigmoid output's too): **+63 us
  CPU, +96 us wall**. The training thread's own CPU is ~+30 us of it (the ops run on TensorFlow's
  threads). On the convnet the same ~0.1 ms is within the noise of a loaded machine (``--calls
  60``: A/A quartiles +-2 ms) and ~0.5 % of its ~19 ms step (spe 8 runs the same ops per batch,
  inside one call).
* So a slow round is not batchtap's work (~0.1 ms a step; its thread sleeps). The likely cause,
  not shown in isolation here (a run beside one busy process was swamped by the other jobs): with
  2 TensorFlow intra-op threads on 2 cores, any other runnable thread takes a core from the step
  while it runs, and the step waits with the same CPU time. A fresh trace per ``fit`` (the
  callback's, and the control's) is not ruled out as a second cause; the control has it too, so
  its spread covers it. Decide on a quiet machine, and read the A/A control before the verdict;
  ``--threads 1,1`` leaves a core to the rest (a different, slower plain step).

Commands (quiet machine; the full matrix takes ~9-15 minutes on 2 cores with the control)::

    KERAS_BACKEND=tensorflow .venv/bin/python bench/keras_fit.py --matrix
    KERAS_BACKEND=tensorflow .venv/bin/python bench/keras_fit.py --jit --steps-per-execution 8
    KERAS_BACKEND=torch .venv/bin/python bench/keras_fit.py

Why XLA is slower than plain TensorFlow here (``--explain-xla`` shows it op by op): on the CPU,
TensorFlow runs the convnet's convolutions and pooling with its oneDNN kernels, while an XLA
cluster runs XLA:CPU's own code for them (Eigen convolutions, a generic select-and-scatter for
the max-pool gradient), several times slower per op on this model; it is compiled once per
``fit`` (the epochs after the first take the same time), so it is a different code path, not a
recompilation. It is the same for all variants, so the ratio still says what batchtap adds.

``--calls N`` (TensorFlow) times N calls of Keras' own train function (what ``fit()`` calls per
``steps_per_execution`` batches) per round, plain, with the callback's hooks and wrapper (its
flushes included) and the A/A control, paired: the per-step cost without fit()'s loop and epochs.

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
import threading
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import batchtap as bt  # noqa: E402
from batchtap.integrations.keras import BatchtapCallback  # noqa: E402

GOAL = 1.02
#: the A/A control: plain fit() again, its train function traced at every fit as batchtap's is
CONTROL = "plain (again)"
#: a round this much slower than the variant's fastest round is counted in the slow mode
SLOW = 1.15


class EpochClock(keras.callbacks.Callback):  # type: ignore[misc]
    """Host wall time, process CPU time (all threads), the training thread's own CPU time and
    batchtap's pipeline thread's wake-ups (voluntary context switches, Linux) between consecutive
    epoch ends (epoch hooks only: no per-batch hook, so Keras keeps its asynchronous batch dispatch
    and no read is added). Put it last among the callbacks: the others' epoch-boundary work then
    falls inside the interval."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self.cpu: list[float] = []
        self.thread_cpu: list[float] = []
        self.wakes: list[float] = []
        self._last = (0.0, 0.0, 0.0, 0)

    def _now(self) -> tuple[float, float, float, int]:
        return (time.perf_counter(), time.process_time(), time.thread_time(), pipeline_switches())

    def on_train_begin(self, logs: Any = None) -> None:
        self._last = self._now()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        now = self._now()
        self.seconds.append(now[0] - self._last[0])
        self.cpu.append(now[1] - self._last[1])
        self.thread_cpu.append(now[2] - self._last[2])
        self.wakes.append(now[3] - self._last[3])
        self._last = now


def pipeline_switches() -> int:
    """Voluntary context switches of batchtap's pipeline thread so far (each one a sleep, so a
    count of its wake-ups); 0 without that thread or off Linux."""
    ids = [t.native_id for t in threading.enumerate() if t.name == "batchtap-pipeline"]
    total = 0
    for tid in ids:
        try:
            with open(f"/proc/self/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


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


def set_threads(spec: str) -> str:
    """Fix the backend's thread pools (before any op runs); returns what was set, for the output."""
    intra, _, inter = spec.partition(",")
    n_intra, n_inter = int(intra), int(inter or 1)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(n_intra)
        tf.config.threading.set_inter_op_parallelism_threads(n_inter)
        return f"TensorFlow intra-op {n_intra}, inter-op {n_inter} threads"
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(n_intra)
        return f"torch {n_intra} threads"
    return "threads left as they are"


class Variant:
    """One variant of a setting: its own compiled model (reused across rounds) and callbacks."""

    def __init__(self, name: str, args: argparse.Namespace, weights: list[Any] | None, shape: tuple[int, ...]) -> None:
        self.name = name
        self.model = make_model(args.model, shape)
        if weights is not None:
            self.model.set_weights(weights)
        self.model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss="sparse_categorical_crossentropy",
            jit_compile=args.jit,
            steps_per_execution=args.steps_per_execution,
        )
        self.tap = bt.Tap(sinks=[], flush_every=50) if name == "batchtap" else None
        self.first: list[float] = []  # the left-out first epochs (tracing, compilation)
        self.epochs: list[float] = []  # every timed epoch's seconds per step, all rounds
        self.thread_cpu: list[float] = []  # the training thread's CPU seconds per step, per round
        self.wakes: list[float] = []  # the pipeline thread's wake-ups per epoch, per round

    def fit(self, x: np.ndarray, y: np.ndarray, args: argparse.Namespace) -> tuple[float, float]:
        """One fit(); wall and process-CPU seconds per step (medians over the timed epochs)."""
        if self.name == CONTROL:
            self.model.train_function = None  # traced again at this fit, as with the callback
        callbacks: list[Any] = []
        if self.tap is not None:
            callbacks.append(BatchtapCallback(self.tap))
        elif self.name == "float(loss)":
            callbacks.append(FloatLoss())
        clock = EpochClock()
        callbacks.append(clock)  # last: the others' epoch-end work is inside its intervals
        self.model.fit(
            x, y, batch_size=args.batch_size, epochs=1 + args.epochs, shuffle=False, verbose=0, callbacks=callbacks
        )
        batches = len(x) // args.batch_size
        self.first.append(clock.seconds[0] / batches)
        self.epochs.extend(t / batches for t in clock.seconds[1:])
        self.thread_cpu.append(statistics.median(clock.thread_cpu[1:]) / batches)
        self.wakes.append(statistics.median(clock.wakes[1:]))
        return statistics.median(clock.seconds[1:]) / batches, statistics.median(clock.cpu[1:]) / batches

    def close(self) -> None:
        if self.tap is not None:
            self.tap.close()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def spread(ratios: list[float]) -> str:
    q1, q2, q3 = quartiles(ratios)
    return f"{q2:.3f}x [{q1:.3f}-{q3:.3f}] ({min(ratios):.3f}-{max(ratios):.3f})"


def verdict(ratios: list[float], control: list[float] | None = None) -> str:
    """``met`` / ``missed`` / ``undecided (why)`` for the paired ratios of batchtap / plain; with
    the A/A control's paired ratios (plain again / plain), undecided where plain vs plain spreads
    more than twice the margin: the machine's noise (or a fresh trace's), not the hooks' cost."""
    if len(ratios) < 5:
        return "undecided (fewer than 5 rounds)"
    if control is not None and len(control) >= 5:
        c1, _, c3 = quartiles(control)
        if c3 - c1 > 2 * (GOAL - 1):
            return f"undecided (plain vs plain again: quartiles {c3 - c1:.3f} apart: the machine, not the hooks)"
    q1, _, q3 = quartiles(ratios)
    if q3 - q1 > 2 * (GOAL - 1):
        return f"undecided (quartiles {q3 - q1:.3f} apart, more than twice the margin)"
    if q3 <= GOAL:
        return "met"
    if q1 > GOAL:
        return "missed"
    return "undecided"


def slow_rounds(times: list[float]) -> str:
    """How many rounds ran in a slow mode: more than SLOW x the variant's fastest round."""
    fastest = min(times)
    return f"{sum(t > SLOW * fastest for t in times)}/{len(times)}"


def fit_table(x: np.ndarray, y: np.ndarray, args: argparse.Namespace, threads: str) -> None:
    names = ["plain", "batchtap"] + ([CONTROL] if args.control else []) + (["float(loss)"] if args.float_loss else [])
    started = time.perf_counter()
    keras.utils.set_random_seed(0)
    weights = make_model(args.model, x.shape[1:]).get_weights()
    variants = [Variant(n, args, weights, x.shape[1:]) for n in names]
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            wall, used = variant.fit(x, y, args)
            times[variant.name].append(wall)
            cpu[variant.name].append(used)
    for variant in variants:
        variant.close()
    by_name = {v.name: v for v in variants}
    batches = len(x) // args.batch_size
    print(
        f"\nkeras {keras.__version__}, backend {keras.backend.backend()}, {args.model}, jit_compile={args.jit}, "
        f"steps_per_execution={args.steps_per_execution}, {threads}; {batches} batches of {args.batch_size}, "
        f"{args.rounds} rounds (ABBA) of fit(epochs={1 + args.epochs}), first epoch of each fit left out; "
        f"load average {tuple(round(v, 2) for v in os.getloadavg())}; {time.perf_counter() - started:.0f} s"
    )
    print(
        "| variant | us per step (median) | paired ratio: median [quartiles] (range) | goal | low-quartile ratio | "
        f"slow rounds (> {SLOW}x its fastest) | CPU us per step | CPU paired ratio | training-thread CPU us per step | "
        "pipeline wake-ups per epoch | rounds (us) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    control = [t / p for t, p in zip(times[CONTROL], times["plain"])] if CONTROL in times else None
    plain_low = quartiles(by_name["plain"].epochs)[0]
    for name in names:
        variant = by_name[name]
        med, cpu_med = statistics.median(times[name]), statistics.median(cpu[name])
        runs = ", ".join(f"{t * 1e6:.0f}" for t in times[name])
        own = (
            f"{slow_rounds(times[name])} | {cpu_med * 1e6:.0f} | "
            f"{{cpu_ratio}} | {statistics.median(variant.thread_cpu) * 1e6:.0f} | "
            f"{statistics.median(variant.wakes):.0f} | {runs} |"
        )
        if name == "plain":
            print(f"| {name} | {med * 1e6:.0f} | 1 | | 1 | " + own.format(cpu_ratio="1"))
            continue
        ratios = [t / p for t, p in zip(times[name], times["plain"])]
        cpu_ratios = [t / p for t, p in zip(cpu[name], cpu["plain"])]
        goal = f"<= {GOAL}: {verdict(ratios, control)}" if name == "batchtap" else ""
        low = quartiles(variant.epochs)[0] / plain_low
        print(
            f"| {name} | {med * 1e6:.0f} | {spread(ratios)} | {goal} | {low:.3f}x | "
            + own.format(cpu_ratio=f"{statistics.median(cpu_ratios):.3f}x")
        )
    first = ", ".join(f"{v.name} {statistics.median(v.first) * 1e6:.0f}" for v in variants)
    print(f"left-out first epochs (tracing/compilation), us per step, median: {first}")


def calls_table(x: np.ndarray, y: np.ndarray, args: argparse.Namespace, threads: str) -> None:
    """Seconds per call of Keras' own train function (TensorFlow; what ``fit()`` calls once per
    ``steps_per_execution`` batches), without fit()'s loop, callbacks and epoch boundaries: plain,
    with ``BatchtapCallback``'s hooks and wrapper (its flushes included), and plain again (the A/A
    control), in paired rounds; wall and process CPU."""
    import tensorflow as tf

    names = ("plain", "batchtap", CONTROL)
    # no drop_remainder: the batch dimension stays unknown while tracing, as in fit()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size).repeat()
    keras.utils.set_random_seed(0)
    weights = make_model(args.model, x.shape[1:]).get_weights()
    calls: dict[str, tuple[Any, Any]] = {}
    callbacks = []
    for name in names:
        variant = Variant(name, args, weights, x.shape[1:])
        model = variant.model
        model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0)  # built, traced once
        if variant.tap is not None:
            callback = BatchtapCallback(variant.tap)
            callback.set_model(model)
            callback.set_params({"verbose": 0, "epochs": 1, "steps": None})
            callback.on_train_begin()  # hooks in, traced again, wrapped: as at a fit()'s start
            callbacks.append((callback, variant))
        else:
            model.make_train_function(force=True)
        iterator = iter(dataset)
        for _ in range(20):
            model.train_function(iterator)
        calls[name] = (model.train_function, iterator)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            function, iterator = calls[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                function(iterator)
            times[name].append((time.perf_counter() - start) / args.calls)
            cpu[name].append((time.process_time() - start_cpu) / args.calls)
    for callback, variant in callbacks:
        callback.on_train_end()
        variant.close()
    print(
        f"\nKeras train function only ({args.model}, jit_compile={args.jit}, steps_per_execution="
        f"{args.steps_per_execution}, {threads}), {args.calls} calls per round, {args.rounds} rounds (ABBA); "
        f"load average {tuple(round(v, 2) for v in os.getloadavg())}"
    )
    print(
        "| variant | us per call (median) | paired - plain, us: median [quartiles] | CPU us per call | CPU paired - plain, us |"
    )
    print("|---|---|---|---|---|")
    for name in names:
        diffs = [(v - p) * 1e6 for v, p in zip(times[name], times["plain"])]
        cpu_diffs = [(v - p) * 1e6 for v, p in zip(cpu[name], cpu["plain"])]
        q1, q2, q3 = quartiles(diffs)
        print(
            f"| {name} | {statistics.median(times[name]) * 1e6:.0f} | {q2:+.0f} [{q1:+.0f}, {q3:+.0f}] | "
            f"{statistics.median(cpu[name]) * 1e6:.0f} | {statistics.median(cpu_diffs):+.0f} |"
        )


def compiled_step_table(x: np.ndarray, y: np.ndarray, args: argparse.Namespace, threads: str) -> None:
    """Seconds per call of a tf.function train step, without and with the hooks, paired rounds."""
    import tensorflow as tf

    from batchtap.integrations._keras_tf import TFRecorder

    steps: dict[str, Any] = {}
    recorders = []
    xb, yb = tf.constant(x[: args.batch_size]), tf.constant(y[: args.batch_size])
    for name in ("plain", "batchtap"):
        model = make_model(args.model, x.shape[1:])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
        model.optimizer.build(model.trainable_variables)
        if name == "batchtap":
            tap = bt.Tap(sinks=[], flush_every=50)
            recorders.append((TFRecorder(model, tap, flush_every=None, freeze_on_nan=True), tap))

        def step(xs: Any, ys: Any, model: Any = model) -> None:
            model.train_step((xs, ys))

        steps[name] = tf.function(tf.autograph.experimental.do_not_convert(step), jit_compile=args.jit)
        for _ in range(50):
            steps[name](xb, yb)
    times: dict[str, list[float]] = {"plain": [], "batchtap": []}
    cpu: dict[str, list[float]] = {"plain": [], "batchtap": []}
    for round_ in range(args.rounds):
        for name in ("plain", "batchtap") if round_ % 2 == 0 else ("batchtap", "plain"):
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.compiled_step):
                steps[name](xb, yb)
            times[name].append((time.perf_counter() - start) / args.compiled_step)
            cpu[name].append((time.process_time() - start_cpu) / args.compiled_step)
    for recorder, tap in recorders:
        recorder.remove()
        tap.close()
    ratios = [b / p for b, p in zip(times["batchtap"], times["plain"])]
    diffs = [(b - p) * 1e6 for b, p in zip(times["batchtap"], times["plain"])]
    cpu_diffs = [(b - p) * 1e6 for b, p in zip(cpu["batchtap"], cpu["plain"])]
    print(
        f"\ncompiled step only ({args.model}, jit_compile={args.jit}, {threads}), {args.compiled_step} calls per "
        f"round, {args.rounds} rounds (ABBA); load average {tuple(round(v, 2) for v in os.getloadavg())}"
    )
    print(
        f"plain {statistics.median(times['plain']) * 1e6:.0f} us, with the hooks "
        f"{statistics.median(times['batchtap']) * 1e6:.0f} us; paired: {statistics.median(diffs):+.0f} us, "
        f"{spread(ratios)}; process CPU per call: plain {statistics.median(cpu['plain']) * 1e6:.0f} us, paired "
        f"{statistics.median(cpu_diffs):+.0f} us [{', '.join(f'{d:+.0f}' for d in sorted(cpu_diffs))}]"
    )


def explain_xla(args: argparse.Namespace) -> None:
    """The convnet's heavy ops, each in a tf.function without and with jit_compile: where XLA:CPU's
    own kernels are slower than TensorFlow's oneDNN ones."""
    import tensorflow as tf

    b = args.batch_size
    x = tf.random.uniform([b, 28, 28, 1])
    h = tf.random.uniform([b, 13, 13, 32])
    k1, k2 = tf.Variable(tf.random.normal([3, 3, 1, 32])), tf.Variable(tf.random.normal([3, 3, 32, 64]))

    def conv(inp: Any, k: Any) -> Any:
        return tf.reduce_sum(tf.nn.conv2d(inp, k, 1, "VALID"))

    def grad(fn: Any, inp: Any, wrt: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(inp)
            out = fn(inp)
        return tape.gradient(out, wrt)

    def pool(inp: Any) -> Any:
        return tf.reduce_sum(tf.nn.max_pool2d(inp, 2, 2, "VALID"))

    cases = [
        ("conv 1->32, forward", lambda: conv(x, k1)),
        ("conv 32->64, forward", lambda: conv(h, k2)),
        ("conv 32->64, input gradient", lambda: grad(lambda i: conv(i, k2), h, h)),
        ("conv 32->64, filter gradient", lambda: grad(lambda i: conv(i, k2), h, k2)),
        ("max-pool, forward", lambda: pool(h)),
        ("max-pool, gradient", lambda: grad(pool, h, h)),
    ]
    print(f"\nms per call, median of 5 x 10 calls (batch {b}); load average {os.getloadavg()}")
    print("| op | TensorFlow (oneDNN) | XLA | XLA / TF |")
    print("|---|---|---|---|")
    for label, fn in cases:
        out = []
        for jit in (False, True):
            compiled = tf.function(fn, jit_compile=jit)
            compiled()
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    compiled()
                samples.append((time.perf_counter() - start) / 10 * 1e3)
            out.append(statistics.median(samples))
        print(f"| {label} | {out[0]:.2f} | {out[1]:.2f} | {out[1] / out[0]:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds per setting (default: 7; XLA 5)")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per fit (after the left-out first)")
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch (default: 64; XLA 24)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 128 (convnet), 32 (mlp)")
    parser.add_argument("--threads", default=f"{os.cpu_count() or 1},1", help="INTRA[,INTER] (default: cores,1)")
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--float-loss", action="store_true", help="also the float(logs['loss']) callback")
    parser.add_argument(
        "--no-control", dest="control", action="store_false", help="leave out the A/A control (plain fit() again)"
    )
    parser.add_argument("--compiled-step", type=int, default=0, help="time N calls of the compiled step only")
    parser.add_argument("--calls", type=int, default=0, help="time N calls of Keras' train function only")
    parser.add_argument("--explain-xla", action="store_true", help="the convnet's ops with and without XLA")
    parser.add_argument("--model", choices=("convnet", "mlp"), default="convnet")
    parser.add_argument("--matrix", action="store_true", help="XLA off/on x steps_per_execution 1/8 (TensorFlow)")
    args = parser.parse_args()
    threads = set_threads(args.threads)
    if args.batch_size is None:
        args.batch_size = 128 if args.model == "convnet" else 32
    print(f"load average at start: {os.getloadavg()}; {threads}")
    if args.explain_xla:
        explain_xla(args)
        return
    shape = (28, 28, 1) if args.model == "convnet" else (32,)
    settings = [(False, 1), (False, 8), (True, 1), (True, 8)] if args.matrix else [(args.jit, args.steps_per_execution)]
    rounds, batches = args.rounds, args.batches
    for jit, spe in settings:
        args.jit, args.steps_per_execution = jit, spe
        # XLA steps are ~5x longer on the CPU (see the docstring): fewer batches and rounds, same rule
        args.rounds = rounds or (5 if jit and args.model == "convnet" else 7)
        args.batches = batches or (24 if jit and args.model == "convnet" else 64)
        rng = np.random.default_rng(0)
        x = rng.uniform(size=(args.batches * args.batch_size, *shape)).astype("float32")
        y = rng.integers(0, 10, size=len(x))
        if args.compiled_step:
            compiled_step_table(x, y, args, threads)
        elif args.calls:
            calls_table(x, y, args, threads)
        else:
            fit_table(x, y, args, threads)


if __name__ == "__main__":
    main()
