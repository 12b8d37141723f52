"""``BatchtapCallback``: per-batch capture for a Lightning ``Trainer``, without per-batch syncs.

``self.log(..., on_step=True)`` turns every logged tensor into a Python float at each step (a
device sync per value on a GPU) and Lightning's NaN check (``EarlyStopping(check_finite=True)``)
runs at epoch or validation ends. This callback drives a :class:`~batchtap.Tap` from
``on_train_batch_end`` instead: values stay on the device until a flush, are validated and stored
by batchtap's sinks, and a non-finite loss stops the ``Trainer`` within a step or two.

Needs ``pip install 'batchtap[lightning]'`` (the unified ``lightning`` package).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from batchtap._fetches import timed_fetches
from batchtap._optional import require
from batchtap.errors import InputError
from batchtap.integrations._lifecycle import finish_as
from batchtap.metrics.inputs import RESERVED_NAMES
from batchtap.tap import Tap

_pl: Any = require("lightning.pytorch", extra="lightning", purpose="batchtap.integrations.lightning")
_fetchers: Any = require("lightning.pytorch.loops.fetchers", extra="lightning", purpose="BatchtapCallback")

__all__ = ["BatchtapCallback"]


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all gradients together, on the device (what ``clip_grad_norm_`` computes)."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if get_total_norm is not None:
        return get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)]))


def _logged_values(trainer: Any, *, on_step: bool) -> dict[str, torch.Tensor]:
    """The ``self.log`` values of the running loop as the device tensors Lightning keeps.

    Read from the loop's result collection rather than ``trainer.callback_metrics``: building that
    also turns every ``prog_bar=True`` value into a float (a host read per value).
    """
    results = getattr(trainer, "_results", None)
    if results is None or not hasattr(results, "valid_items"):
        return {}
    out: dict[str, torch.Tensor] = {}
    for _, metric in results.valid_items():
        if not (metric.meta.on_step if on_step else metric.meta.on_epoch):
            continue
        # for on_epoch values this is Lightning's own epoch reduction (cached; device ops only)
        value = results._get_cache(metric, on_step)
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            out[results._forked_name(metric, on_step)[1]] = value
    return out


#: Trainer settings stored with the run (``config["trainer"]``): those that change what the
#: numbers mean (accumulation, precision, clipping, limits) and how the run was laid out
_TRAINER_SETTINGS = (
    "max_epochs",
    "max_steps",
    "accumulate_grad_batches",
    "precision",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "log_every_n_steps",
    "val_check_interval",
    "check_val_every_n_epoch",
    "limit_train_batches",
    "limit_val_batches",
    "num_devices",
    "num_nodes",
)


def _run_config(trainer: Any, pl_module: Any) -> dict[str, Any]:
    """The run's config: the module's hyperparameters (without Lightning's internal keys, such as
    the ``_instantiator`` LightningCLI adds) and the Trainer's settings under ``"trainer"`` (a
    LightningCLI run gives its trainer settings to the Trainer, not to the module)."""
    hparams = dict(getattr(pl_module, "hparams", {}) or {})
    config = {k: v for k, v in hparams.items() if not (isinstance(k, str) and k.startswith("_"))}
    settings: dict[str, Any] = {}
    for name in _TRAINER_SETTINGS:
        value = getattr(trainer, name, None)
        if value is None:
            continue
        settings[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    for part in ("strategy", "accelerator"):
        value = getattr(trainer, part, None)
        if value is not None:
            settings[part] = type(value).__name__
    config["trainer" if "trainer" not in config else "lightning_trainer"] = settings
    return config


class _Fetches:
    """The fetches of one epoch from Lightning's training fetcher, as an iterator ``tap.watch`` can time.

    Each ``next`` is the fetcher's own ``__next__`` (what Lightning's profiler times as
    ``train_dataloader_next``): the loop's wait for its batch, not its hooks or validation. For a
    loader without a length the fetcher hands out a batch it fetched one call earlier, so that
    ``next`` times the *following* batch's fetch; the fetcher then keeps each batch's own wait
    (``_WatchedFetcher.batchtap_wait``), which the callback passes to the Tap instead.
    """

    def __init__(self, fetcher: Any) -> None:
        self.fetcher = fetcher
        # the batches left in this epoch (a resumed epoch starts part-way), None when unknown
        self.length = None if fetcher.length is None else max(int(fetcher.length) - int(fetcher.fetched), 0)

    def __iter__(self) -> _Fetches:
        return self

    def __next__(self) -> Any:
        fetcher = self.fetcher
        batch = _fetchers._PrefetchDataFetcher.__next__(fetcher)
        waits = fetcher._batchtap_waits
        fetcher.batchtap_wait = waits.popleft() if waits else math.nan  # the wait of the batch handed out
        return batch

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("the epoch's length is unknown")  # what len() of an iterable dataset raises
        return self.length


class _WatchedFetcher(_fetchers._PrefetchDataFetcher):  # type: ignore[misc]
    """Lightning's training fetcher with each epoch's fetches going through ``tap.watch``, and each
    fetch from the loader timed.

    The fit loop makes the fetcher and starts its first epoch's iteration (prefetching the first
    batch of a loader without a length) before any callback hook; the callback therefore watches
    the fit loop's ``_data_fetcher`` being set (``_watching_loop``) and gives the new fetcher this
    class (``__next__``, and ``iterator``: each fetch from the loader's iterator timed, in the order
    the batches are handed out) for the fit, and takes it back at its end.
    """

    _batchtap_watch: Callable[[_Fetches], Iterator[Any]] | None
    _batchtap_watched: Iterator[Any] | None
    _batchtap_waits: deque[float]  # fetched, not yet handed out: one wait per batch, oldest first
    _batchtap_raw: Iterator[Any] | None
    _batchtap_timed: Iterator[Any] | None
    batchtap_wait: float  # the wait of the batch handed out last (NaN: fetched before it was watched)

    @property  # type: ignore[override]
    def iterator(self) -> Iterator[Any] | None:
        return self._batchtap_timed

    @iterator.setter
    def iterator(self, raw: Iterator[Any] | None) -> None:  # each epoch: iter(combined_loader)
        self._batchtap_waits.clear()
        self._batchtap_raw = raw
        self._batchtap_timed = (
            None if raw is None else timed_fetches(raw, self._batchtap_waits.append, time.perf_counter)
        )

    def __next__(self) -> Any:
        watch = self._batchtap_watch
        if watch is None:  # before the epoch's hook (not in a fit this callback runs)
            return _Fetches(self).__next__()
        watched = self._batchtap_watched
        if watched is None:
            watched = self._batchtap_watched = watch(_Fetches(self))
        return next(watched)


def _adopt(fetcher: Any) -> None:
    """Give a fresh training fetcher ``_WatchedFetcher``'s class and state (its current iteration
    kept: batches it prefetched before are handed out with an unknown wait, NaN)."""
    if type(fetcher) is not _fetchers._PrefetchDataFetcher:
        return  # a training_step taking dataloader_iter fetches by itself
    raw = fetcher.__dict__.pop("iterator", None)
    fetcher.__class__ = _WatchedFetcher
    fetcher._batchtap_waits = deque()
    fetcher._batchtap_watch = None
    fetcher._batchtap_watched = None
    fetcher.batchtap_wait = math.nan
    fetcher.iterator = raw
    fetcher._batchtap_waits.extend(math.nan for _ in fetcher.batches)


def _release(fetcher: Any) -> None:
    if type(fetcher) is not _WatchedFetcher:
        return
    raw = fetcher._batchtap_raw
    fetcher.__class__ = _fetchers._PrefetchDataFetcher
    for name in ("_batchtap_watch", "_batchtap_watched", "_batchtap_waits", "_batchtap_raw", "_batchtap_timed"):
        fetcher.__dict__.pop(name, None)
    fetcher.__dict__.pop("batchtap_wait", None)
    fetcher.iterator = raw


_LOOPS: dict[type, type] = {}


def _watching_loop(kind: type) -> type:
    """A subclass of the fit loop's class whose ``_data_fetcher``, when set, is adopted at once:
    ``FitLoop.setup_data`` makes the fetcher and iterates it in one go, with no hook between."""
    if kind not in _LOOPS:

        def get(loop: Any) -> Any:
            return loop.__dict__.get("_batchtap_data_fetcher")

        def put(loop: Any, fetcher: Any) -> None:
            _adopt(fetcher)
            loop.__dict__["_batchtap_data_fetcher"] = fetcher

        _LOOPS[kind] = type(kind.__name__, (kind,), {"_data_fetcher": property(get, put), "_batchtap_loop": True})
    return _LOOPS[kind]


def _second_item(batch: Any) -> Any:
    return batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None


class BatchtapCallback(_pl.Callback):  # type: ignore[misc]
    """Capture every optimizer step of a Lightning ``Trainer`` into a :class:`~batchtap.Tap`.

    ``training_step`` returns the loss, or a dict with ``"loss"`` and, for accuracy, the class
    scores under ``outputs_key`` (``{"loss": loss, "logits": logits}``). Targets come from the
    batch (by default its second item). When the Tap asks to stop (NaN guard, a stop rule), the
    callback sets ``trainer.should_stop``; the run is stored as stopped with the reason.

    What it records besides the Tap's own metrics:

    * ``accumulate_grad_batches=N``: each batch goes to :meth:`Tap.accumulate` (with the loss
      Lightning divided by N multiplied back), and one record is written per optimizer step;
      record steps count ``trainer.global_step``.
    * ``grad_norm``: the total gradient norm, computed on the device in
      ``on_before_optimizer_step`` (after AMP unscaling, before gradient clipping: the norm
      clipping sees), unless the Tap already has a :class:`~batchtap.metrics.GradNorm`.
    * ``lr`` (``lr_opt{i}`` for further optimizers): the first param group's learning rate,
      read on the host, unless the Tap already has a :class:`~batchtap.metrics.LearningRate`.
    * ``data_time``: the wait for each batch, timed around the fit loop's fetch as
      :meth:`Tap.watch` times a loader (which also numbers the steps and starts each step's clock
      when its batch arrives, so ``step_time`` leaves the wait out); summed over the micro-batches
      of an optimizer step. Not for a ``training_step`` that takes ``dataloader_iter`` (it fetches
      by itself), nor for a loader without a length when the Tap samples (``sample_every > 1``).
    * ``self.log(...)`` values as sparse values (:meth:`Tap.log`), no sync added: values logged
      ``on_step`` at each optimizer step (the last micro-batch's, as Lightning's own loggers get
      them), ``on_epoch`` values at the end of each training epoch, validation values at the end
      of each validation run (not the sanity check). They are taken as the device tensors
      Lightning keeps, copied to the host asynchronously, never turned into floats here. A name
      that is also a per-step value or record field (``loss``, ``step``...) is stored as
      ``logged_<name>``.

    The run starts at ``on_fit_start`` (the optimizers exist from there on), so a failure in the
    sanity check is stored too; an exception anywhere in ``fit()`` ends it as ``failed``
    (``stopped`` on Ctrl-C) with every captured step stored.

    Args:
        tap: the Tap to drive (metrics, sinks, rules as you configure them). Default: a Tap with
            the default metrics, storing to the default SQLite store and the console.
        name: run name (default: the LightningModule's class name).
        config: run config to store (default: the module's ``hparams`` without Lightning's internal
            ``_``-keys, and the Trainer's settings under ``"trainer"``: accumulation, precision, ...).
        outputs_key: key of the class scores in ``training_step``'s dict output.
        targets: ``batch -> targets`` (default: ``batch[1]``); return None for no targets.

    Example (not run here: it trains)::

        tap = bt.Tap(sinks=[bt.sinks.Console(every=10), bt.sinks.SQLite("runs/batchtap.db")])
        trainer = lightning.Trainer(max_epochs=5, accumulate_grad_batches=4, callbacks=[BatchtapCallback(tap)])
        trainer.fit(module, loader)
    """

    def __init__(
        self,
        tap: Tap | None = None,
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        outputs_key: str = "logits",
        targets: Callable[[Any], Any] = _second_item,
    ) -> None:
        super().__init__()
        self.tap = tap
        self._own_tap = tap is None
        self.name = name
        self.config = config
        self.outputs_key = outputs_key
        self.targets = targets
        self._running = False
        self._global_step = 0  # trainer.global_step at the last recorded optimizer step
        self._grad_norm: torch.Tensor | None = None  # this optimizer step's norm, on the device
        self._own_grad_norm = True
        self._own_lr = True
        self._lr: dict[str, float] = {}  # learning rates read before this optimizer step
        self._logged: dict[str, torch.Tensor] = {}  # the self.log tensor last stored per name
        self._fetcher: Any = None  # the fit loop's training fetcher while its fetches are watched
        self._loop: Any = None  # the fit loop while its _data_fetcher is watched (_watching_loop)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # The optimizers exist from here on (configure_optimizers ran in strategy.setup).
        if self.tap is None:
            self.tap = Tap()
        names = {type(m).__name__ for m in self.tap.metrics}
        self._own_grad_norm = "GradNorm" not in names
        self._own_lr = "LearningRate" not in names
        config = self.config if self.config is not None else _run_config(trainer, pl_module)
        self.tap.start(name=self.name or type(pl_module).__name__, config=config)
        self._running = True
        self._logged = {}
        # the fit loop makes its training fetcher and prefetches from it before any later hook:
        # adopt the fetcher as it is set (restored in _end)
        loop = getattr(trainer, "fit_loop", None)
        if loop is not None and not getattr(type(loop), "_batchtap_loop", False) and "_data_fetcher" in vars(loop):
            fetcher = loop.__dict__.pop("_data_fetcher")
            loop.__class__ = _watching_loop(type(loop))
            loop._data_fetcher = fetcher
            self._loop = loop

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._global_step = trainer.global_step  # restored from a checkpoint after on_fit_start

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # After the loop made (or remade, reload_dataloaders_every_n_epochs) this epoch's fetcher
        # and before its first hand-out.
        self._unwatch()  # the last epoch's watch stays suspended after its last batch: end it
        fetcher: Any = getattr(trainer.fit_loop, "_data_fetcher", None)
        if self.tap is None or not self._running:
            return
        _adopt(fetcher)  # the loop's own fetcher where its _data_fetcher was not watched (see _watching_loop)
        if type(fetcher) is not _WatchedFetcher:
            return  # a training_step taking dataloader_iter fetches by itself
        fetcher._batchtap_watched = None
        epoch = trainer.current_epoch
        fetcher._batchtap_watch = lambda fetches: self._watch(fetches, epoch)
        self._fetcher = fetcher

    def _watch(self, fetches: _Fetches, epoch: int) -> Iterator[Any]:
        tap = self.tap
        if tap is None or not self._running or (fetches.length is None and tap.sample_every > 1):
            return fetches  # without a length, sampling would fetch one batch ahead of the loop
        return tap.watch(fetches, epoch=epoch)

    def _own_wait(self) -> float | None:
        """The wait of the batch just handed out where the fetcher fetched it one call ahead (a loader
        without a length), else None (``tap.watch``'s own timing of the hand-out is that wait)."""
        fetcher = self._fetcher
        if fetcher is None or fetcher.length is not None or fetcher._batchtap_watched is None:
            return None
        wait = fetcher.batchtap_wait
        return None if math.isnan(wait) else wait

    def _unwatch(self, *, restore: bool = False) -> None:
        fetcher = self._fetcher
        if fetcher is not None:
            watched, fetcher._batchtap_watched = fetcher._batchtap_watched, None
            fetcher._batchtap_watch = None
            close = getattr(watched, "close", None)
            if close is not None:
                close()
        if restore:
            self._fetcher = None
            loop = self._loop
            self._loop = None
            if loop is not None and getattr(type(loop), "_batchtap_loop", False):
                fetcher = loop.__dict__.pop("_batchtap_data_fetcher", None)
                loop.__class__ = type(loop).__mro__[1]
                loop._data_fetcher = fetcher
            _release(fetcher)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._running:
            return
        if self._own_lr:  # the rate this optimizer step uses (a scheduler may change it before batch end)
            self._lr = self._lr_extra(trainer)
        if not self._own_grad_norm:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            with torch.no_grad():
                self._grad_norm = _total_norm(grads)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        tap = self.tap
        if tap is None or not self._running:
            return
        scores = None
        if isinstance(outputs, Mapping):
            loss = outputs.get("loss")
            scores = outputs.get(self.outputs_key)
        else:
            loss = outputs
        if loss is None:
            raise InputError(
                "training_step returned no loss (got None or a dict without 'loss'), so batchtap has "
                "nothing to record; return the loss, or {'loss': loss, 'logits': logits}"
            )
        targets = self.targets(batch) if scores is not None else None
        if not isinstance(targets, torch.Tensor):
            targets, scores = None, None  # no accuracy without targets
        stepped = trainer.global_step != self._global_step  # the optimizer ran in this batch
        accumulate = trainer.accumulate_grad_batches
        extra, self._lr = (self._lr, {}) if stepped and self._own_lr else ({}, self._lr)
        wait = self._own_wait()
        if accumulate == 1 and stepped and wait is None:
            tap.step(
                loss=loss,
                outputs=scores,
                targets=targets,
                extra=extra,
                grad_norm=self._take_grad_norm(),
                epoch=trainer.current_epoch,
                batch=batch_idx,
            )
        else:
            # Lightning hands back the loss it divided by accumulate_grad_batches for backward()
            tap.accumulate(loss=loss.detach() * accumulate, outputs=scores, targets=targets, data_time=wait)
            if stepped:
                tap.step(extra=extra, grad_norm=self._take_grad_norm(), epoch=trainer.current_epoch, batch=batch_idx)
        self._global_step = trainer.global_step
        if stepped:
            self._log_new(trainer, on_step=True)
        if tap.should_stop:
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.tap is not None and self._running:
            self._log_new(trainer, on_step=False)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.tap is not None and self._running and not trainer.sanity_checking and self.tap.run_info is not None:
            self._log_new(trainer, on_step=False)

    def _log_new(self, trainer: Any, *, on_step: bool) -> None:
        """Store the ``self.log`` values logged since the last call, as sparse values."""
        tap = self.tap
        assert tap is not None
        taken = set(tap.run_info.metrics) if tap.run_info is not None else set()
        new: dict[str, torch.Tensor] = {}
        for name, value in _logged_values(trainer, on_step=on_step).items():
            if self._logged.get(name) is value:
                continue  # not logged again since it was stored
            self._logged[name] = value
            new[f"logged_{name}" if name in taken or name in RESERVED_NAMES else name] = value
        if new:
            tap.log(new)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end(None)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._unwatch(restore=True)  # a fit that never trained (no on_train_end) leaves the loop as it was too

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._end(exception)

    def _take_grad_norm(self) -> torch.Tensor | None:
        norm, self._grad_norm = self._grad_norm, None
        return norm

    def _lr_extra(self, trainer: Any) -> dict[str, float]:
        return {
            "lr" if i == 0 else f"lr_opt{i}": float(opt.param_groups[0]["lr"])  # a host float: no device read
            for i, opt in enumerate(trainer.optimizers)
        }

    def _end(self, exc: BaseException | None) -> None:
        self._unwatch(restore=True)
        tap = self.tap
        if self._running and tap is not None:
            self._running = False
            finish_as(tap, exc)
        if self._own_tap and tap is not None:
            tap.close()
            self.tap = None
