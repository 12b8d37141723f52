"""``BatchtapCallback``: per-batch capture for a Lightning ``Trainer``, without per-batch syncs.

``self.log(..., on_step=True)`` turns every logged tensor into a Python float at each step (a
device sync per value on a GPU) and Lightning's NaN check (``EarlyStopping(check_finite=True)``)
runs at epoch or validation ends. This callback drives a :class:`~batchtap.Tap` from
``on_train_batch_end`` instead: values stay on the device until a flush, are validated and stored
by batchtap's sinks, and a non-finite loss stops the ``Trainer`` within a step or two.

Needs ``pip install 'batchtap[lightning]'`` (the unified ``lightning`` package).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from batchtap._optional import require
from batchtap.errors import InputError
from batchtap.tap import Tap

_pl: Any = require("lightning.pytorch", extra="lightning", purpose="batchtap.integrations.lightning")

__all__ = ["BatchtapCallback"]


def _second_item(batch: Any) -> Any:
    return batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None


class BatchtapCallback(_pl.Callback):  # type: ignore[misc]
    """Capture every training batch of a Lightning ``Trainer`` into a :class:`~batchtap.Tap`.

    ``training_step`` returns the loss, or a dict with ``"loss"`` and, for accuracy, the class
    scores under ``outputs_key`` (``{"loss": loss, "logits": logits}``). Targets come from the
    batch (by default its second item). When the Tap asks to stop (NaN guard, a stop rule), the
    callback sets ``trainer.should_stop``; the run is stored as stopped with the reason.

    Args:
        tap: the Tap to drive (metrics, sinks, rules as you configure them). Default: a Tap with
            the default metrics plus learning rate and gradient norm, writing to the console.
        name: run name (default: the LightningModule's class name).
        config: run config to store (default: the module's ``hparams``).
        outputs_key: key of the class scores in ``training_step``'s dict output.
        targets: ``batch -> targets`` (default: ``batch[1]``); return None for no targets.

    Example (not run here: it trains)::

        tap = bt.Tap(sinks=[bt.sinks.Console(every=10), bt.sinks.SQLite("runs/batchtap.db")])
        trainer = lightning.Trainer(max_epochs=5, callbacks=[BatchtapCallback(tap)])
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
        self._run: contextlib.AbstractContextManager[Any] | None = None  # the entered tap.run()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.tap is None:
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            self.tap = Tap(optimizer=optimizer, model=pl_module)
        config = self.config if self.config is not None else dict(getattr(pl_module, "hparams", {}) or {})
        self._run = self.tap.run(name=self.name or type(pl_module).__name__, config=config)
        self._run.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        tap = self.tap
        if tap is None or self._run is None:
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
        tap.step(loss=loss, outputs=scores, targets=targets, epoch=trainer.current_epoch, batch=batch_idx)
        if tap.should_stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._end(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._end(exception)

    def _end(self, exc: BaseException | None) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.__exit__(type(exc) if exc else None, exc, exc.__traceback__ if exc else None)
        if self._own_tap and self.tap is not None:
            self.tap.close()
            self.tap = None
