"""What autolog changes in Lightning: its training fetcher is watched where it hands batches out.

Lightning's fit loop asks its fetcher (``_PrefetchDataFetcher``) for each batch. For a loader without
a length the fetcher fetches one batch ahead of what it hands out (to know which batch is the last):
the first epoch's first batch is fetched inside ``fit()``'s set-up, and each later hand-out fetches
the batch after it. Watching the ``DataLoader`` beneath would number and time those fetches, so each
training pass of the fetcher is watched instead (``LoaderWatch.fetcher_pass`` / ``fetcher_next``),
each of its fetches timed (``fetcher_fetch``: its base class's ``__next__``, one batch of every loader
it combines). Its ``__iter__``, ``__next__``, ``teardown`` and that fetch are wrapped while autolog is
on (both packages, ``lightning`` and ``pytorch_lightning``, when imported now or later); nothing else
of Lightning is touched. Lightning never asks past a sized epoch's last batch, so a pass ends when the next one
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

    def fetcher_fetch(self, fetcher: Any, fetch: Callable[[Any], Any]) -> Any: ...

    def fetcher_end(self, fetcher: Any) -> None: ...


def watch_fetchers(loaders: FetcherWatch, patches: PatchRegistry, module: ModuleType) -> None:
    """Wrap ``module._PrefetchDataFetcher``'s ``__iter__``, ``__next__`` and ``teardown``, and the
    fetch of its base class (``_DataFetcher.__next__``), undone with ``patches``, so that its training
    passes go through ``loaders``."""
    kind = getattr(module, "_PrefetchDataFetcher", None)
    base = getattr(module, "_DataFetcher", None)
    if (
        not isinstance(kind, type)
        or not isinstance(base, type)
        or not issubclass(kind, base)
        or not all(name in vars(c) for c, name in ((kind, "__iter__"), (kind, "__next__"), (base, "__next__")))
    ):
        return  # a Lightning without them: its DataLoader is watched as any other
    begin = vars(kind)["__iter__"]
    hand_out = vars(kind)["__next__"]
    end = getattr(kind, "teardown", None)
    fetch = vars(base)["__next__"]

    def __iter__(self: Any) -> Any:
        if type(self) is not kind or not loaders.enabled or not torch.is_grad_enabled():
            return begin(self)
        return loaders.fetcher_pass(self, begin, hand_out)

    def __next__(self: Any) -> Any:
        return loaders.fetcher_next(self, hand_out)

    def fetch_next(self: Any) -> Any:  # one fetch from the loaders (the prefetch's, the refill's)
        return loaders.fetcher_fetch(self, fetch)

    def teardown(self: Any) -> Any:  # the end of fit(): its last pass, left suspended, ends too
        loaders.fetcher_end(self)
        return end(self)  # type: ignore[misc]

    __iter__.__wrapped__ = begin  # type: ignore[attr-defined]
    __next__.__wrapped__ = hand_out  # type: ignore[attr-defined]
    patches.replace(kind, "__iter__", __iter__)
    patches.replace(kind, "__next__", __next__)
    fetch_next.__name__ = "__next__"
    fetch_next.__wrapped__ = fetch  # type: ignore[attr-defined]
    patches.replace(base, "__next__", fetch_next)
    if callable(end):
        teardown.__wrapped__ = end  # type: ignore[attr-defined]
        patches.replace(kind, "teardown", teardown)
