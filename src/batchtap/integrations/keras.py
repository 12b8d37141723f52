"""``BatchtapCallback``: exact per-batch values from Keras 3 ``fit()``, with no added host read.

Keras' own ``logs["loss"]`` at ``on_train_batch_end`` is the running mean since the epoch began,
not the batch's loss, and turning the logs into Python floats is a host read per value per call.
This callback records each batch's own values instead, the way batchtap records a PyTorch loop:

* it hooks ``model.compute_loss`` (loss, y, y_pred) and ``model.optimizer.apply`` (gradients) on
  the instances for the length of ``fit()``, and never overrides ``on_train_batch_end`` (that would
  make Keras convert every log value in the training thread, on every backend);
* on the **torch** backend each step goes straight to ``tap.step()`` (batchtap's metrics, the NaN
  guard at the same step, a non-finite gradient norm stopping the run at its step too,
  ``model.stop_training`` when the Tap asks to stop);
* on the **TensorFlow** backend each step writes one row into a ``tf.Variable`` ring inside the
  compiled step (``jit_compile`` and ``steps_per_execution`` included: still one row per batch),
  read back once per flush and handed to the Tap's pipeline as one block (``Tap.hand_over``: the
  same domain checks, anomaly events, NaN stop and rules as a PyTorch block); a non-finite loss or
  gradient norm freezes the optimizer in the graph from the next step on.

JAX is out of scope (its train step is a pure function: a ring would have to travel in the
state Keras threads through it). Needs ``pip install 'batchtap[keras]'``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from batchtap._optional import require
from batchtap.errors import ConfigError
from batchtap.integrations._keras_console import ConsoleHold, draws_a_bar
from batchtap.integrations._lifecycle import finish_as
from batchtap.integrations._tf_ring import TFCapture
from batchtap.tap import Tap

_keras: Any = require("keras", extra="keras", purpose="batchtap.integrations.keras")

__all__ = ["BatchtapCallback", "TFCapture"]

log = logging.getLogger("batchtap")

#: exceptions Keras raises inside the train function to end an epoch's data, and catches itself
_END_OF_DATA = ("OutOfRangeError", "StopIteration")

_NO_LOSS = (
    "the model's train_step neither calls self.compute_loss(...) nor (TensorFlow) updates a metric named "
    "'loss', so batchtap cannot find the step's loss and records no steps; fix: compute the loss with "
    "self.compute_loss(x=x, y=y, y_pred=y_pred) (on TensorFlow, keeping it in a keras.metrics.Mean(name='loss') "
    "also works)"
)

#: compiled metrics batchtap records itself per batch (top-1 accuracy of class scores)
_RECORDED = frozenset(
    {"loss", "compile_metrics", "accuracy", "acc", "sparse_categorical_accuracy", "categorical_accuracy"}
)


def _compiled_metric_names(model: Any) -> list[str]:
    """Names of the compiled metrics (``metrics=[...]`` of ``compile``) batchtap does not store per
    batch: all but top-1 accuracy (per output too: ``head_a_accuracy``)."""
    outputs = [str(n) for n in (getattr(model, "output_names", None) or [])]
    names: list[str] = []
    compiled = vars(model).get("_compile_metrics")
    for metric in getattr(compiled, "metrics", None) or []:
        name = str(getattr(metric, "name", ""))
        base = next((name[len(o) + 1 :] for o in outputs if name.startswith(f"{o}_")), name)
        if name and base not in _RECORDED and name not in names:
            names.append(name)
    return names


class BatchtapCallback(_keras.callbacks.Callback):  # type: ignore[misc]
    """Record every training batch of ``model.fit()`` into a :class:`~batchtap.Tap`.

    Per batch: ``loss`` (what ``compute_loss`` returned: Keras' total, sample- and class-weighted
    as Keras weights it, loss weights and regularization included), ``accuracy`` (top-1, for class
    scores ``[..., C]`` with class-index or one-hot targets; unweighted), with several outputs
    ``loss/<output>`` and ``accuracy/<output>`` per output (both backends), ``lr`` (the rate the step
    used, schedules included), ``grad_norm`` (global L2 norm of the dense gradients, unscaled under
    ``LossScaleOptimizer``; a skipped step is a ``skip`` event), ``step_time`` and ``throughput``.
    Validation results (``val_*``) are stored as sparse values at each epoch end, with that epoch;
    ``evaluate(..., callbacks=[cb])`` results too (as ``eval_*``) while a run is open. Compiled
    metrics other than accuracy (``mae``, ``AUC``...) are not stored per batch: the run names them
    in a warning event.

    The run: if no run of the Tap is open when ``fit()`` starts, the callback starts one (named
    after the model) and ends it when ``fit()`` ends — ``failed`` on an exception in a training
    step, ``stopped`` on Ctrl-C or a stop request. Inside ``with tap.run(...)`` it uses that run
    and leaves ending it to you (then ``fit`` and ``evaluate`` share the run).

    Args:
        tap: the Tap to feed; any Tap works on both backends (on TensorFlow the values come from
            the step itself; metrics it cannot measure there, such as memory, are named once in
            a warning event). Default: ``bt.Tap()`` (the default store and console). Whatever the
            Tap, its console never breaks Keras' progress bar: while ``fit(verbose=1)`` draws
            it, the console's lines are held and printed between bars (at each epoch's start,
            and when ``fit()`` ends; see ``_keras_console.py``); ``evaluate(verbose=1)``'s bar
            likewise, its lines printed right after it.
        name: run name when the callback starts the run (default: ``model.name``).
        config: run config to store when the callback starts the run.
        flush_every: TensorFlow only: read the device ring after about this many steps
            (default: ``tap.flush_every``); a NaN stop reaches ``model.stop_training`` then.

    Example (not run here: it trains)::

        tap = bt.Tap(sinks=[bt.sinks.SQLite("runs/batchtap.db")])
        model.fit(x, y, epochs=3, callbacks=[BatchtapCallback(tap)])
    """

    def __init__(
        self,
        tap: Tap | None = None,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        flush_every: int | None = None,
    ) -> None:
        super().__init__()
        self.backend = _keras.backend.backend()
        if self.backend not in ("tensorflow", "torch"):
            raise ConfigError(
                f"batchtap.integrations.keras supports the 'tensorflow' and 'torch' Keras backends, got "
                f"{self.backend!r} (JAX is out of scope: its train step is a pure function, with no place for a "
                "device ring); fix: set KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch"
            )
        self.tap = tap
        self._own_tap = tap is None
        self.name = name
        self.config = config
        self.flush_every = flush_every
        self._recorder: Any = None
        self._own_run = False
        self._in_fit = False
        self._epoch = 0
        self._batch = 0
        self._last_reads = 0
        self._hold: ConsoleHold | None = None

    # ------------------------------------------------------------------ fit

    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        if getattr(model, "optimizer", None) is None:
            raise ConfigError(
                "BatchtapCallback needs a compiled model with an optimizer; call model.compile(...) first"
            )
        if self.tap is None:
            self.tap = Tap()
        tap = self.tap
        self._finish_stale_run()
        self._in_fit = True
        self._epoch = self._batch = 0
        self._said_no_loss = False
        # the hooks first: a set-up that fails leaves no run behind
        if self.backend == "torch":
            from batchtap.integrations._keras_torch import TorchRecorder

            self._recorder = TorchRecorder(model, tap, self._next_position)
        else:
            from batchtap.integrations._keras_tf import TFRecorder

            self._recorder = TFRecorder(model, tap, flush_every=self.flush_every, freeze_on_nan=tap.nan_guard)
        try:
            if tap.run_info is None:
                tap.start(name=self.name or getattr(model, "name", None), config=self.config)
                self._own_run = True
            # Keras made its train function before this hook: make it again so it traces our hooks
            model.make_train_function(force=True)
            self._wrap_train_function(model)
        except BaseException:
            self._recorder.remove()
            self._recorder = None
            self._in_fit = False
            if self._own_run and tap.run_info is not None:
                self._own_run = False
                tap.finish("stopped", reason="BatchtapCallback could not set up (see the exception); nothing trained")
            raise
        self._describe(model, tap)
        self._stop_stale_hold()
        if draws_a_bar(self.params):
            # Keras redraws its bar in place: batchtap's console lines wait for the bar's line to end
            self._hold = ConsoleHold(tap)
            self._hold.start()

    def _describe(self, model: Any, tap: Tap) -> None:
        """The run's environment (backend, versions, jit, steps_per_execution), and the compiled
        metrics that are not stored per batch, named once."""
        info = tap.run_info
        if info is None:
            return
        env: dict[str, Any] = {
            "keras_backend": self.backend,
            "keras": getattr(_keras, "__version__", "?"),
            "jit_compile": bool(getattr(model, "jit_compile", False)),
            "steps_per_execution": int(getattr(model, "steps_per_execution", 1) or 1),
        }
        if self.backend == "tensorflow":
            import tensorflow as tf

            env["tensorflow"] = tf.__version__
            env["device"] = "tensorflow:GPU" if tf.config.list_logical_devices("GPU") else "tensorflow:CPU"
            for key in ("torch", "cuda", "cudnn"):  # a TensorFlow run trains without them
                info.environment.pop(key, None)
        info.environment.update(env)

    def _wrap_train_function(self, model: Any) -> None:
        original = model.train_function
        capture = self._recorder.capture if self.backend == "tensorflow" else None

        def train_function(*args: Any, **kwargs: Any) -> Any:
            if capture is not None:
                capture.call_started()
            try:
                out = original(*args, **kwargs)
            except BaseException as exc:
                if type(exc).__name__ not in _END_OF_DATA:
                    self._end(exc)
                elif capture is not None:
                    capture.advance()
                raise
            if capture is not None:
                capture.advance()
                if capture.should_stop:
                    model.stop_training = True
            self._say_no_loss()
            return out

        model.train_function = train_function

    def _say_no_loss(self) -> None:
        """Once, after the first call (Keras builds its compiled metrics while tracing it): the
        compiled metrics not stored per batch, and a custom train_step in which no loss was found."""
        if self._said_no_loss or self._recorder is None or self.tap is None or self.tap.run_info is None:
            return
        self._said_no_loss = True
        unstored = _compiled_metric_names(self.model)
        if unstored:
            self.tap.warn(
                f"compiled metrics not stored per batch: {', '.join(unstored)} (Keras' logs hold running means "
                "over the epoch; batchtap stores loss, accuracy, lr and grad_norm per batch, val_* per epoch)",
                info=True,  # a choice of what is stored, not a degradation
            )
        if getattr(self._recorder, "no_loss", False):
            self.tap.warn(_NO_LOSS)

    def _next_position(self) -> tuple[int, int]:
        position = (self._epoch, self._batch)
        self._batch += 1
        return position

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch, self._batch = epoch, 0
        if self._hold is not None:
            self._hold.release()  # Keras ended the last epoch's bar with its line: print between bars
        if self.backend == "tensorflow" and self._recorder is not None:
            self._recorder.capture.new_epoch(epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._drain()
        tap = self.tap
        if tap is None or tap.run_info is None:
            return
        # Keras already turned these into Python floats (its own read, made with or without us);
        # stored at the epoch's last step, with its epoch
        values = {k: v for k, v in (logs or {}).items() if k.startswith("val_") and isinstance(v, (int, float))}
        if values:
            tap.log(values, epoch=epoch)

    def on_train_end(self, logs: Any = None) -> None:
        self._end(None)

    def on_test_begin(self, logs: Any = None) -> None:
        tap = self.tap
        if self._in_fit or tap is None or tap.run_info is None:
            return  # inside fit() its own hold covers validation; with no run, nothing is printed
        self._stop_stale_hold()
        if draws_a_bar(self.params):
            # evaluate(verbose=1) draws a bar of its own: the console's lines wait for its end
            self._hold = ConsoleHold(tap)
            self._hold.start()

    def on_test_end(self, logs: Any = None) -> None:
        if self._in_fit:
            return  # validation inside fit(): stored with the epoch's end as val_*
        try:
            self._log_evaluation(logs)
        finally:
            hold, self._hold = self._hold, None
            if hold is not None:
                # Keras ends its bar after this hook (its progress logger is the last callback)
                hold.stop_after_line()

    def _log_evaluation(self, logs: Any) -> None:
        tap = self.tap
        values = {f"eval_{k}": v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        if tap is None or tap.run_info is None:
            if values:
                log.warning(
                    "batchtap: evaluate() results not stored: no run is open; run fit() and evaluate() inside "
                    "`with tap.run(...)` to store them with the run"
                )
            return
        if values:
            tap.log(values)

    # ------------------------------------------------------------------ internals

    def _drain(self) -> None:
        """TensorFlow: hand the ring's rows to the Tap (one read of the ring)."""
        if self.backend == "tensorflow" and self._recorder is not None and self.tap is not None:
            if self.tap.run_info is not None:
                self._recorder.capture.flush()
            if self.tap.should_stop and self.model is not None:
                self.model.stop_training = True

    @property
    def host_reads(self) -> int:
        """Device reads this callback made (TensorFlow: two per flush that found rows; torch: 0)."""
        capture = getattr(self._recorder, "capture", None)
        return capture.host_reads if capture is not None else self._last_reads

    def _end(self, exc: BaseException | None) -> None:
        """End of fit(), however it ended: rows stored, hooks off, the run ended if it is ours."""
        if not self._in_fit:
            return
        self._in_fit = False
        tap = self.tap
        try:
            if exc is None or not isinstance(exc, KeyboardInterrupt):
                self._drain()
        finally:
            recorder, self._recorder = self._recorder, None
            if recorder is not None:
                recorder.remove()
                self._keep_reads(recorder)
            model = self.model
            if model is not None:
                model.train_function = None  # rebuilt without the hooks by the next fit()
            if self._own_run and tap is not None and tap.run_info is not None:
                self._own_run = False
                if exc is None and getattr(recorder, "no_loss", False) and tap.steps_recorded == 0:
                    tap.finish("finished", reason=f"0 steps recorded: {_NO_LOSS}")
                else:
                    finish_as(tap, exc)
            hold, self._hold = self._hold, None
            if hold is not None:
                hold.stop()  # after the run's end line (held lines first), or what the run shows so far
            if self._own_tap and tap is not None and exc is not None:
                tap.close()
                self.tap = None

    def _stop_stale_hold(self) -> None:
        """An evaluate() that raised never reached on_test_end: let its hold go now."""
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.stop()

    def _keep_reads(self, recorder: Any) -> None:
        capture = getattr(recorder, "capture", None)
        self._last_reads = capture.host_reads if capture is not None else 0

    def _finish_stale_run(self) -> None:
        """A run this callback started whose fit() ended by an exception outside a training step
        (a callback's, the data pipeline's on the torch backend): end it as failed now."""
        if self._own_run and self.tap is not None and self.tap.run_info is not None:
            self._own_run = False
            self.tap.finish("failed", reason="the previous fit() ended by an exception outside a training step")
