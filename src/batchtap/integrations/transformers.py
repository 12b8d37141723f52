"""``BatchtapTrainer``: every optimizer step of a Hugging Face ``Trainer`` captured without host reads.

A ``TrainerCallback`` never sees the loss, the logits or the labels, and the gradient norm the
``Trainer`` computes stays a local variable of its loop. So the integration is a ``Trainer``
mixin (:class:`BatchtapMixin`, ready-made as :class:`BatchtapTrainer`) that declares two
overrides and registers its own callback:

* ``compute_loss``: hands each training micro-batch's loss, logits and labels to
  :meth:`Tap.accumulate` (device ops only);
* ``_get_grad_norm``: keeps the norm the ``Trainer`` computed (before clipping) for the step;
* a callback: starts the run at ``on_train_begin`` (the optimizer exists), closes each optimizer
  step with :meth:`Tap.step` at ``on_optimizer_step`` (learning rate, grad norm, samples, tokens),
  stores evaluation metrics with :meth:`Tap.log`, stops training when the Tap asks, finishes the run
  at ``on_train_end``; ``train()`` itself marks the run failed (every captured step stored) when
  training raises.

The recorded ``loss`` of a step is batchtap's one definition (docs/autolog.md, "The step's loss"):
the loss over the step's samples (tokens, for a loss normalized by ``num_items_in_batch``). It is the
``Trainer``'s own logged ``loss`` (``trainer.state.log_history`` with ``logging_steps=1``) except in
one case, said once per run (an ``info`` event): a model whose loss the ``Trainer`` divides by the
number of micro-batches (no ``num_items_in_batch``) logs the mean of the micro-batch means, which is
not the mean over the step's samples when its micro-batches differ in size (an epoch's last one).
Each step's ``data_time`` is the wait for its batches, timed around the training ``DataLoader``'s
own fetches (beneath Accelerate's loader, which fetches one batch ahead).

Needs ``pip install 'batchtap[transformers]'``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch

from batchtap._fetches import timed_fetches
from batchtap._optional import require
from batchtap.errors import InputError
from batchtap.integrations._lifecycle import finish_as
from batchtap.metrics.inputs import RESERVED_NAMES
from batchtap.tap import Tap

_tf: Any = require("transformers", extra="transformers", purpose="batchtap.integrations.transformers")

__all__ = [
    "BatchtapMixin",
    "BatchtapTrainer",
    "NAN_FILTER_ADVICE",
    "loss_sum_quirk",
    "mean_of_means_note",
]

log = logging.getLogger("batchtap")

#: What batchtap tells a user whose ``TrainingArguments`` keep ``logging_nan_inf_filter=True``.
NAN_FILTER_ADVICE = (
    "TrainingArguments(logging_nan_inf_filter=True) (the default) reads the loss on the host after every "
    "micro-batch (`torch.isnan(loss) or torch.isinf(loss)`): a device sync per micro-batch, reported at about "
    "7 % of step time on GPUs (transformers#33693). batchtap's NaN guard watches the loss without a sync and "
    "stops training within a step or two of a non-finite loss; pass logging_nan_inf_filter=False to save it."
)


class _Driver:
    """The run behind one ``BatchtapMixin`` trainer: host-side counters and the Tap calls."""

    def __init__(self, tap: Tap | None, name: str | None, shift_labels: bool | None) -> None:
        self.tap = tap
        self.own_tap = tap is None
        self.name = name
        self.shift_labels = shift_labels
        self.running = False
        self.shift = False  # causal LM: logits at position t predict label t + 1
        self.own_lr = True
        self.grad_norm: torch.Tensor | float | None = None  # the Trainer's norm of the open step
        self.micro = 0  # micro-batches of the open optimizer step
        self.samples = 0
        self.tokens = 0
        self.epoch = 0
        self.next_epoch = 0
        self.batch = -1  # index of the last training micro-batch within the epoch
        self.waits: deque[float] = deque()  # loader waits of batches fetched, not yet trained on
        self.sizes: list[int] = []  # samples of the open step's micro-batches, when the Trainer divides by their count
        self.said_mean_of_means = False
        self.ignores_count = False  # the model takes **kwargs but computes its own per-micro-batch mean

    def begin(self, trainer: Any, args: Any, state: Any, model: Any) -> None:
        if self.running:  # a second train() call without the end of the first one
            self.end(None)
        if self.tap is None:
            self.tap = Tap()
        names = {type(m).__name__ for m in self.tap.metrics}
        self.own_lr = "LearningRate" not in names
        self.shift = self.shift_labels if self.shift_labels is not None else _is_causal_lm(trainer, model)
        if getattr(args, "logging_nan_inf_filter", False):
            log.warning("batchtap: %s", NAN_FILTER_ADVICE)
        if not hasattr(_tf.Trainer, "_get_grad_norm"):
            log.warning("batchtap: this transformers version has no Trainer._get_grad_norm; grad_norm is not recorded")
        run_name = self.name or getattr(args, "run_name", None) or type(_unwrap(model)).__name__
        self.tap.start(name=run_name, config=args.to_dict())
        self.ignores_count = _ignores_count(trainer, model)
        quirk = loss_sum_quirk(trainer, model)
        if quirk is not None:
            self.tap.warn(quirk)  # an event with the run, and a log line
        self.running = True
        self.micro = self.samples = self.tokens = 0
        self.grad_norm = None
        self.next_epoch = int(state.epoch or 0)
        self.waits.clear()
        self.sizes = []
        self.said_mean_of_means = False

    def epoch_begin(self) -> None:
        self.epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        self.batch = -1
        self.waits.clear()  # a loop stopped mid-epoch (max_steps) leaves fetched batches behind

    def time_fetches(self, loader: Any) -> None:
        """Time each fetch of the training ``loader``'s underlying ``DataLoader``, on the host clock.

        Accelerate's loader (what the ``Trainer`` iterates) fetches one batch ahead and calls its
        ``base_dataloader.__iter__()`` by name, so an instance attribute there sees every fetch in
        order; each wait waits in :attr:`waits` until its batch reaches ``compute_loss``.
        """
        kind = type(loader)
        if kind.__name__ == "DataLoaderDispatcher" and kind.__module__.startswith("accelerate."):
            self._time_dispatches(loader, kind)
            return
        base = getattr(loader, "base_dataloader", None)
        if not isinstance(base, torch.utils.data.DataLoader) or "__iter__" in vars(base):
            return  # not Accelerate's loader (no fetch to time), or timed already

        def __iter__() -> Iterator[Any]:
            return self._timed(type(base).__iter__(base))

        base.__iter__ = __iter__  # type: ignore[method-assign,assignment]

    def _time_dispatches(self, loader: Any, kind: type) -> None:
        """A ``DataLoaderDispatcher`` (``dispatch_batches``, Accelerate's default for an
        ``IterableDataset``): the main process fetches ``num_processes`` batches of the
        ``DataLoader`` per dispatched batch and broadcasts them, the others wait in that broadcast,
        all inside its ``_fetch_batches`` (called by name, one batch ahead): each call is one
        dispatched batch's wait, on every process. The call that finds the loader exhausted adds a
        wait no batch takes; the next epoch's start clears it."""
        if "_fetch_batches" in vars(loader):
            return  # timed already
        fetch = kind._fetch_batches  # type: ignore[attr-defined]
        waits = self.waits

        def _fetch_batches(iterator: Any) -> Any:
            started = time.perf_counter()
            try:
                return fetch(loader, iterator)
            finally:
                waits.append(time.perf_counter() - started)

        loader._fetch_batches = _fetch_batches

    def _timed(self, iterator: Iterator[Any]) -> Iterator[Any]:
        return timed_fetches(iterator, self.waits.append, time.perf_counter)

    def micro_batch(self, loss: torch.Tensor, scores: Any, targets: Any, input_ids: Any, *, per_sample: bool) -> None:
        """One training micro-batch; ``loss`` scaled so that the mean over the step's micro-batches
        (sample-weighted when ``per_sample``: the loss is that micro-batch's own mean) is the step's loss."""
        tap = self.tap
        assert tap is not None
        if not (isinstance(scores, torch.Tensor) and isinstance(targets, torch.Tensor)) or targets.is_floating_point():
            scores, targets = None, None  # no accuracy without integer labels (regression, no labels)
        elif self.shift and scores.dim() == 3 and targets.dim() == 2:
            scores, targets = scores[:, :-1], targets[:, 1:]  # views: no copy, no host read
        first = input_ids if isinstance(input_ids, torch.Tensor) else targets
        size = int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 0  # shape metadata
        # A loss normalized over the whole step weighs every micro-batch alike (batch_size=1); a
        # micro-batch mean weighs by its samples. The step's samples go to step() for throughput.
        weight = size if per_sample and size else 1
        wait = self.waits.popleft() if self.waits else None
        tap.accumulate(loss=loss, outputs=scores, targets=targets, batch_size=weight, data_time=wait)
        self.micro += 1
        self.batch += 1
        self.samples += size
        if per_sample and size:
            self.sizes.append(size)
        if isinstance(input_ids, torch.Tensor):
            self.tokens += input_ids.numel()

    def optimizer_step(self, optimizer: Any) -> bool:
        """Close the optimizer step; True when the Tap asks training to stop."""
        tap = self.tap
        assert tap is not None
        if self.micro == 0:
            raise InputError(
                "the Trainer stepped its optimizer but no training micro-batch reached BatchtapMixin.compute_loss; "
                "a compute_loss override of your own must call super().compute_loss(...)"
            )
        if len(set(self.sizes)) > 1 and not self.said_mean_of_means:
            self.said_mean_of_means = True
            tap.warn(mean_of_means_note(self.sizes), info=True)
        self.sizes = []
        extra = {"lr": float(optimizer.param_groups[0]["lr"])} if self.own_lr else {}  # a host float
        norm, self.grad_norm = self.grad_norm, None
        tap.step(
            extra=extra,
            grad_norm=norm,
            batch_size=self.samples or None,
            tokens=(self.tokens or None) if self.shift else None,  # LMs count tokens/s, classifiers samples/s
            epoch=self.epoch,
            batch=max(self.batch, 0),
        )
        self.micro = self.samples = self.tokens = 0
        return tap.should_stop

    def evaluated(self, metrics: Mapping[str, Any]) -> None:
        tap = self.tap
        if tap is None or not self.running:
            return
        taken = set(tap.run_info.metrics) if tap.run_info is not None else set()
        values = {
            k: float(v)
            for k, v in metrics.items()  # the Trainer's evaluation values are host numbers already
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in taken and k not in RESERVED_NAMES
        }
        if values:
            tap.log(values)

    def end(self, exc: BaseException | None) -> None:
        tap = self.tap
        if self.running and tap is not None:
            self.running = False
            finish_as(tap, exc)
        if self.own_tap and tap is not None:
            tap.close()
            self.tap = None


class _Callback(_tf.TrainerCallback):  # type: ignore[misc]
    """The lifecycle half of :class:`BatchtapMixin` (registered by it; not for use on its own)."""

    def __init__(self, trainer: Any, driver: _Driver) -> None:
        self.trainer = trainer
        self.driver = driver

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.driver.begin(self.trainer, args, state, kwargs.get("model"))

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.driver.epoch_begin()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.driver.running and self.driver.optimizer_step(kwargs["optimizer"]):
            control.should_training_stop = True
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.driver.evaluated(kwargs.get("metrics") or {})

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.driver.end(None)


class BatchtapMixin:
    """Mix into any ``transformers.Trainer`` subclass to capture every optimizer step into a Tap.

    ``class MyTrainer(BatchtapMixin, SFTTrainer): pass`` (the mixin first); :class:`BatchtapTrainer`
    is ``BatchtapMixin`` + ``Trainer``. Each optimizer step becomes one record with:

    * ``loss``: the step's loss over its samples (see the module docstring: the ``Trainer``'s own
      logged loss but where it is a mean of unequal micro-batches' means, said once), correct
      under ``gradient_accumulation_steps`` and for a shorter last step of an epoch;
    * ``data_time``: the wait for the step's batches (the sum over its micro-batches);
    * ``accuracy``: over every labelled position of every micro-batch, ``-100`` ignored; for causal
      LMs (the ``Trainer``'s own test: the model's class is a causal LM) logits at position ``t``
      are compared with label ``t + 1``; sequence classifiers get per-example accuracy;
    * ``grad_norm``: the norm the ``Trainer`` computed (before clipping with ``max_grad_norm``);
    * ``lr``: the learning rate the step used (unless the Tap has its own ``LearningRate``);
    * ``step_time``, ``throughput`` (tokens/s of ``input_ids`` for causal LMs, samples/s otherwise).

    Evaluation metrics (``eval_loss``...) are stored as sparse values (:meth:`Tap.log`). When the
    Tap asks to stop (its NaN guard, a stop rule), training stops at that step and the run is
    stored as ``stopped``; when ``train()`` raises, as ``failed``, with every captured step stored.

    Args:
        *args: the ``Trainer``'s own positional arguments.
        tap: the Tap to drive. Default: a Tap with the default metrics storing to the default
            SQLite store and the console, closed at the end of ``train()``.
        tap_run_name: the run's name (default: ``args.run_name``, else the model's class name).
        tap_shift_labels: compare logits at ``t`` with labels at ``t + 1`` (default: when the
            model is a causal LM).
        **kwargs: the ``Trainer``'s own keyword arguments.

    Example (not run here: it trains; tests/integrations/test_transformers.py runs the README's)::

        tap = bt.Tap(sinks=[bt.sinks.SQLite("runs/batchtap.db")])
        args = TrainingArguments("out", gradient_accumulation_steps=4, logging_nan_inf_filter=False)
        BatchtapTrainer(model=model, args=args, train_dataset=ds, tap=tap).train()
    """

    def __init__(
        self,
        *args: Any,
        tap: Tap | None = None,
        tap_run_name: str | None = None,
        tap_shift_labels: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.batchtap = _Driver(tap, tap_run_name, tap_shift_labels)
        cast(Any, self).add_callback(_Callback(self, self.batchtap))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a run that raises is stored as ``failed`` (``stopped`` on Ctrl-C)."""
        try:
            return cast(Any, super()).train(*args, **kwargs)
        except BaseException as exc:
            self.batchtap.end(exc)
            raise

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """``Trainer.compute_loss``, plus each training micro-batch handed to :meth:`Tap.accumulate`."""
        base = cast(Any, super())
        driver = self.batchtap
        if not (driver.running and model.training):  # evaluation and prediction pass straight through
            return base.compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        # Taken before the call: the Trainer pops "labels" when a label smoother or compute_loss_func computes the loss.
        shifted = inputs.get("shift_labels")
        targets = shifted if shifted is not None else inputs.get("labels")
        input_ids = inputs.get("input_ids")
        loss, outputs = base.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        scores = outputs.get("logits") if isinstance(outputs, Mapping) else None
        if shifted is not None:
            driver.shift = False  # the collator shifted them already
        scaled, per_sample = self._batchtap_loss(loss.detach(), num_items_in_batch)
        driver.micro_batch(scaled, scores, targets, input_ids, per_sample=per_sample)
        return (loss, outputs) if return_outputs else loss

    def get_train_dataloader(self) -> Any:
        """``Trainer.get_train_dataloader``, its fetches timed for each step's ``data_time``."""
        loader = cast(Any, super()).get_train_dataloader()
        self.batchtap.time_fetches(loader)
        return loader

    def _batchtap_loss(self, loss: torch.Tensor, num_items_in_batch: Any) -> tuple[torch.Tensor, bool]:
        """The micro-batch's loss for :meth:`Tap.accumulate`, and whether it is the micro-batch's own
        mean (then weighed by its samples: the step's loss is the mean over the step's samples).

        ``Trainer.training_step`` adds ``loss / n_micro`` per micro-batch (a per-micro-batch mean), or
        ``loss`` itself when the loss is already normalized over the whole step; the same rule here.
        """
        trainer = cast(Any, self)
        if loss.dim() > 0:
            loss = loss.mean()  # DataParallel: one loss per GPU, averaged as training_step does
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or (
                getattr(trainer, "compute_loss_func", None) is not None
            )
        if not scaled:
            return loss, True
        micro = (
            getattr(trainer, "current_gradient_accumulation_steps", None) or trainer.args.gradient_accumulation_steps
        )
        if self.batchtap.ignores_count:
            # The Trainer multiplied a plain per-micro-batch mean by its process count (meant to cancel
            # DDP's gradient mean for a loss divided by the count of all ranks' tokens): undone here, so
            # batchtap's mean across ranks is the mean of the ranks' own losses. A model that does use
            # the count keeps the factor: its loss is its rank's share of the global Σ CE / N, and the
            # factor times batchtap's mean across ranks is that share summed over the ranks.
            return loss * (micro / _process_factor(trainer, num_items_in_batch)), False
        return loss * micro, False

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        norm = cast(Any, super())._get_grad_norm(model, grad_norm=grad_norm)
        self.batchtap.grad_norm = norm  # a device tensor (or the float DeepSpeed returns): kept, not read
        return norm


class BatchtapTrainer(BatchtapMixin, _tf.Trainer):  # type: ignore[misc]
    """A ``transformers.Trainer`` with :class:`BatchtapMixin`: ``BatchtapTrainer(..., tap=tap)``."""


def loss_sum_quirk(trainer: Any, model: Any) -> str | None:
    """Why the Trainer's loss is the micro-batches' *sum* of means, or a multiple of it, when it is.

    A model whose ``forward`` takes ``**kwargs`` gets ``num_items_in_batch`` from the ``Trainer``,
    which then takes its loss as normalized over the whole step: it adds the micro-batches' losses
    undivided, and under DDP multiplies each by the number of processes (to cancel DDP's gradient
    mean for a loss divided by all ranks' tokens). A model that computes a plain per-micro-batch mean
    anyway (BERT-like models: a ``CrossEntropyLoss()`` of their own, neither ``self.loss_function``
    nor ``num_items_in_batch`` in ``forward``) then gets a Trainer loss (and gradients) of
    ``gradient_accumulation_steps x processes`` times the mean. batchtap undoes the process factor
    (its own mean across ranks combines the ranks) and keeps the sum over micro-batches (what the
    step's gradients add up). Decided once per ``train()`` from the settings and the source of
    ``forward``; None when the case does not arise (neither accumulation nor several processes, a
    model that declares ``accepts_loss_kwargs``, a ``compute_loss_func``, a forward that uses the count).
    """
    steps = int(getattr(trainer.args, "gradient_accumulation_steps", 1) or 1)
    processes = _process_factor(trainer, 1)
    if (steps <= 1 and processes <= 1) or not _ignores_count(trainer, model):
        return None
    name = type(_unwrap(model)).__name__
    does = []
    if steps > 1:
        does.append(f"adds the {steps} micro-batch losses of each step undivided")
    if processes > 1:
        does.append(f"multiplies each by its {processes} processes (to cancel DDP's gradient mean)")
    factors = " x ".join(
        [*([f"{steps} micro-batches"] if steps > 1 else []), *([f"{processes} processes"] if processes > 1 else [])]
    )
    stored = f"their sum, {steps}x the step's mean loss" if steps > 1 else "the step's mean loss"
    return (
        f"{name}.forward takes **kwargs, so the Trainer passes it num_items_in_batch and takes its loss as "
        f"normalized over the step: it {' and '.join(does)}, but {name} computes a per-micro-batch mean (its forward "
        f"uses neither self.loss_function nor num_items_in_batch): the Trainer's logged loss and the gradients are "
        f"{steps * processes}x the step's mean loss ({factors}); batchtap stores {stored}"
        + (" (the process factor undone: batchtap averages the ranks itself)" if processes > 1 else "")
        + "; fix: set trainer.model_accepts_loss_kwargs = False before train() (or model.accepts_loss_kwargs = False)"
    )


def _ignores_count(trainer: Any, model: Any) -> bool:
    """Whether the Trainer passes ``num_items_in_batch`` to a model whose loss ignores it: its
    ``forward`` takes ``**kwargs`` but neither uses the count nor ``self.loss_function``."""
    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        return False
    if getattr(trainer, "compute_loss_func", None) is not None or getattr(trainer, "loss_is_scaled_for_ga", None):
        return False
    unwrapped = _unwrap(model)
    if hasattr(unwrapped, "accepts_loss_kwargs"):
        return False  # the model says what it does with the count
    import inspect

    try:
        source = inspect.getsource(type(unwrapped).forward)
    except (OSError, TypeError):
        return False  # no source to tell from: say nothing rather than guess
    return "loss_function" not in source and "num_items_in_batch" not in source


def _process_factor(trainer: Any, num_items_in_batch: Any) -> int:
    """The factor ``Trainer.compute_loss`` multiplied the loss by (transformers >= 4.46): the number
    of processes over the tensor-parallel size (the GPUs under DataParallel), applied when tokens are
    averaged across devices, the model takes loss kwargs (or a ``compute_loss_func`` is set) and a
    count was passed; else 1."""
    args = trainer.args
    if not (
        getattr(args, "average_tokens_across_devices", False)
        and (getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None))
        and num_items_in_batch is not None
    ):
        return 1
    n_gpu = int(getattr(args, "n_gpu", 1) or 1)
    if n_gpu > 1:
        return n_gpu
    accelerator = getattr(trainer, "accelerator", None)
    processes = int(getattr(accelerator, "num_processes", 1) or 1)
    tp_size = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
    return max(processes // int(tp_size or 1), 1)


def mean_of_means_note(sizes: list[int]) -> str:
    """Why the Trainer's logged loss of a step with micro-batches of ``sizes`` samples is not batchtap's."""
    k, total = len(sizes), sum(sizes)
    shown = ", ".join(str(s) for s in sizes)
    return (
        "the Trainer's logged loss differs from batchtap's wherever a step's micro-batches differ in size "
        f"(here {shown} samples): the Trainer divides each micro-batch's mean loss by the {k} micro-batches "
        f"and adds them (a mean of means: each micro-batch weighs 1/{k}), batchtap stores the mean loss over "
        f"the step's {total} samples (docs/autolog.md, \"The step's loss\"); with equal micro-batches the two agree"
    )


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # DDP / DataParallel
    return model


def _is_causal_lm(trainer: Any, model: Any) -> bool:
    """The Trainer's own tests: its loss shifts labels, or the model's class is a causal LM."""
    if getattr(trainer, "_loss_shifts_labels", False):
        return True
    auto = require("transformers.models.auto.modeling_auto", extra="transformers", purpose="BatchtapMixin")
    return type(_unwrap(model)).__name__ in set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
