"""What autolog changes in Lightning: its training fetcher is watched where it hands batches out.

Lightning's fit loop asks its fetcher (``_PrefetchDataFetcher``) for each batch. For a loader without
a length the fetcher fetches one batch ahead of what it hands out (to know which batch is the last):
the first epoch's first batch is fetched inside ``fit()``'s set-up, and each later hand-out fetches
the batch after it. Watching the ``DataLoader`` beneath would number and time those fetches, so each
training pass of the fetcher is watched instead (``LoaderWatch.fetcher_pass`` / ``fetcher_next``):
its ``__iter__``, ``__next__`` and ``teardown`` are wrapped while autolog is on (both packages,
``lightning`` and ``pytorch_lightning``, when imported now or later), nothing else of Lightning is
touched. Lightning never asks past a sized epoch's last batch, so a pass ends when the next one
begins (the same fetcher, or a new one: ``reload_dataloaders_every_n_epochs``) or when the fetcher is
torn down at the end of ``fit()``.

A pass is a training pass where gradients are enabled (Lightning's evaluation loops run under
``no_grad``/``inference_mode``), and the fetcher is Lightning's own class exactly (a training step
taking ``dataloader_iter`` gets another fetcher, and ``BatchtapCallback`` its own subclass, which
times the fetches itself).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import torch

from batchtap.autolog._patches import PatchRegistry

__all__ = ["LIGHTNING_FETCHERS", "FetcherWatch", "watch_fetchers"]

LIGHTNING_FETCHERS = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")


class FetcherWatch(Protocol):
    """What the wrapped fetcher needs of autolog's loader watch (``_loader.LoaderWatch``)."""

    enabled: bool

    def fetcher_pass(self, fetcher: Any, begin: Callable[[Any], Any], hand_out: Callable[[Any], Any]) -> Any: ...

    def fetcher_next(self, fetcher: Any, hand_out: Callable[[Any], Any]) -> Any: ...

    def fetcher_end(self, fetcher: Any) -> None: ...


def watch_fetchers(loaders: FetcherWatch, patches: PatchRegistry, module: ModuleType) -> None:
    """Wrap ``module._PrefetchDataFetcher``'s ``__iter__``, ``__next__`` and ``teardown`` (undone with
    ``patches``) so that its training passes go through ``loaders``."""
    kind = getattr(module, "_PrefetchDataFetcher", None)
    if not isinstance(kind, type) or "__iter__" not in vars(kind) or "__next__" not in vars(kind):
        return  # a Lightning without it: its DataLoader is watched as any other
    begin = vars(kind)["__iter__"]
    hand_out = vars(kind)["__next__"]
    end = getattr(kind, "teardown", None)

    def __iter__(self: Any) -> Any:
        if type(self) is not kind or not loaders.enabled or not torch.is_grad_enabled():
            return begin(self)
        return loaders.fetcher_pass(self, begin, hand_out)

    def __next__(self: Any) -> Any:
        return loaders.fetcher_next(self, hand_out)

    def teardown(self: Any) -> Any:  # the end of fit(): its last pass, left suspended, ends too
        loaders.fetcher_end(self)
        return end(self)  # type: ignore[misc]

    __iter__.__wrapped__ = begin  # type: ignore[attr-defined]
    __next__.__wrapped__ = hand_out  # type: ignore[attr-defined]
    patches.replace(kind, "__iter__", __iter__)
    patches.replace(kind, "__next__", __next__)
    if callable(end):
        teardown.__wrapped__ = end  # type: ignore[attr-defined]
        patches.replace(kind, "teardown", teardown)
