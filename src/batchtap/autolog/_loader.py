"""The training ``DataLoader``'s wait per batch, through ``tap.watch``.

``DataLoader.__iter__`` is wrapped: an iteration begun with gradients enabled, while no other
watched iteration is running, goes through ``tap.watch`` (which numbers epochs and batches, times
the wait for each batch and starts each step's clock when its first batch is handed out).
Evaluation loaders stay out: one iterated under ``no_grad``/``inference_mode`` is never watched,
nor one iterated inside the training loop, and a loader whose whole iteration saw no optimizer
step is not watched again (its wait would otherwise land in the next training step).

A new iteration of the loader being watched ends the old one: a loop that knows the epoch's
length never asks past its last batch, and Lightning's fit loop makes the next epoch's iterator
while it still holds the previous one, so the old iteration is left suspended, not finished.

Accelerate's prepared loader (``DataLoaderShard``, what the HF ``Trainer`` iterates) is not a
``DataLoader`` (only its ``__class__`` says so) and fetches one batch ahead of what it hands out:
watching the ``DataLoader`` beneath it would number and time its fetches, not the loop's batches
(a step stored with the batch after its own, the epoch's last step without its wait). Its own
``__iter__`` is wrapped the same way (when ``accelerate.data_loader`` is imported, now or later),
and ``tap.watch`` times the fetches beneath it (``capture/loader.py``); the ``DataLoader`` it
iterates inside is then not watched again. Each handed-out batch's wait is queued (``waits``) for
the micro-batch that trains on it: the HF ``Trainer`` fetches all of a step's micro-batches before
the first backward.

Lightning's training fetcher (``_PrefetchDataFetcher``) fetches one batch ahead of what it hands out
when the loader has no length (the first epoch's first batch inside ``fit()``'s set-up): watching
its ``DataLoader`` would number and time the fetches (step n stored as batch n + 1 with that batch's
wait). So a training pass of the fetcher itself is watched (``_lightning.py``): its hand-outs are the
batches; each of its fetches (one batch of every loader it combines) is timed and queued
(``batchtap_fetches``), so each batch handed out gets its own fetch's wait; the ``DataLoader``
iterated inside it is not watched. Sized loaders go the same way (the fetcher then fetches what it
hands out).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import DataLoader

from batchtap.autolog._lightning import LIGHTNING_FETCHERS, watch_fetchers
from batchtap.autolog._patches import PatchRegistry

__all__ = ["LoaderWatch"]


class LoaderWatch:
    """Routes training-loader iterations through ``watch``.

    Args:
        watch: ``tap.watch``-like: takes an iterable, yields its items (None while no run is open).
        steps: how many optimizer steps have been seen so far.
        waits: where each handed-out batch's wait is appended (read by the micro-batch that trains on it).
    """

    def __init__(
        self, watch: Callable[[Any], Iterator[Any] | None], steps: Callable[[], int], waits: deque[float]
    ) -> None:
        self._watch = watch
        self._steps = steps
        self._waits = waits
        self._running: weakref.ref[Any] | None = None  # the watched iteration in progress
        self._running_loader: weakref.ref[Any] | None = None  # the loader it iterates
        self._eval: weakref.WeakSet[Any] = weakref.WeakSet()
        # the fit loop's training fetcher and its watched pass (_lightning.py), and the fetches of the
        # pass fetching now (the fetcher's own fetches are timed into them; its DataLoader is not watched)
        self._fetcher_pass: tuple[Any, Iterator[Any]] | None = None
        self._beneath: _Fetches | None = None
        self.enabled = True

    def install(self, patches: PatchRegistry) -> None:
        self._watch_iterations(patches, DataLoader)
        _when_imported(patches, _ACCELERATE, lambda m: self._wrap_shard(patches, m))
        for name in LIGHTNING_FETCHERS:
            _when_imported(patches, name, lambda m: watch_fetchers(self, patches, m))

    def _wrap_shard(self, patches: PatchRegistry, module: ModuleType) -> None:
        shard = getattr(module, "DataLoaderShard", None)
        if not isinstance(shard, type) or "__iter__" not in vars(shard):
            return  # an Accelerate without it: its loaders' DataLoader is watched as any other
        self._watch_iterations(patches, shard)

    def _watch_iterations(self, patches: PatchRegistry, owner: type) -> None:
        """Patch ``owner.__iter__`` so that training iterations (grad enabled, not traced) are watched."""
        original = vars(owner)["__iter__"]
        loaders = self

        def __iter__(self: Any) -> Any:
            iterator = original(self)
            if loaders.enabled and torch.is_grad_enabled() and not torch.compiler.is_compiling():
                if loaders._beneath is not None:  # inside a Lightning fetcher's pass: its hand-outs are watched
                    return iterator
                watched = loaders._watched(self, iterator)
                return iterator if watched is None else watched
            return iterator

        __iter__.__wrapped__ = original  # type: ignore[attr-defined]
        patches.replace(owner, "__iter__", __iter__)

    def fetcher_pass(self, fetcher: Any, begin: Callable[[Any], Any], hand_out: Callable[[Any], Any]) -> Any:
        """A Lightning fetcher's training pass begins (``begin``: its class's own ``__iter__``, which
        may prefetch): its hand-outs (``hand_out``: its own ``__next__``) are watched, its fetches
        (``fetcher_fetch``) timed beneath them. Returns what ``begin`` returned.

        The fit loop's last pass, left suspended after its last batch, ends here, whether the loop
        iterates the same fetcher again or made a new one (``reload_dataloaders_every_n_epochs``).
        """
        self._end_fetcher_pass()
        fetches = _Fetches(fetcher)
        outer, self._beneath = self._beneath, fetches
        try:
            begun = begin(fetcher)
        finally:
            self._beneath = outer
        watched = self._watched(fetcher, _HandOuts(self, fetches, fetcher, hand_out), fetches.waits)
        if watched is None:  # not watched (no run open, another pass running, evaluation): keep no waits
            fetches.kept = False
            fetches.waits.clear()
        else:
            self._fetcher_pass = (fetcher, watched)
        return begun

    def fetcher_next(self, fetcher: Any, hand_out: Callable[[Any], Any]) -> Any:
        """The fetcher's next batch: through its watched pass where it has one."""
        current = self._fetcher_pass if self.enabled else None
        return hand_out(fetcher) if current is None or current[0] is not fetcher else next(current[1])

    def fetcher_fetch(self, fetcher: Any, fetch: Callable[[Any], Any]) -> Any:
        """One fetch of the fetcher from its loaders (``fetch``: Lightning's ``_DataFetcher.__next__``,
        one batch of every loader it combines), timed where it belongs to the pass fetching now."""
        beneath = self._beneath
        if beneath is None or beneath.fetcher is not fetcher:
            return fetch(fetcher)
        started = time.perf_counter()
        batch = fetch(fetcher)  # the end of the loaders (StopIteration) is not a fetch
        beneath.add(time.perf_counter() - started)
        return batch

    def fetcher_end(self, fetcher: Any) -> None:
        """The fetcher is torn down (the end of ``fit()``): its pass, left suspended, ends, so that a
        loop after the fit is watched again."""
        if self._fetcher_pass is not None and self._fetcher_pass[0] is fetcher:
            self._end_fetcher_pass()

    def _end_fetcher_pass(self) -> None:
        last, self._fetcher_pass = self._fetcher_pass, None
        close = getattr(last[1], "close", None) if last is not None else None
        if close is not None:
            close()

    def _watched(self, loader: Any, iterator: Any, fetches: deque[float] | None = None) -> Iterator[Any] | None:
        """``iterator`` (a pass of ``loader`` just begun) through the watch, or None where it is not
        watched; ``fetches``: the waits of its fetches, timed beneath it (a Lightning fetcher's)."""
        running = self._running() if self._running is not None else None
        if running is not None and self._running_loader is not None and self._running_loader() is loader:
            running.close()  # the same loader again: its old pass was left suspended at its end
            running = None
        if running is not None or loader in self._eval:
            return None
        self._waits.clear()  # a new pass: waits of the last one's batches never trained on are not this one's
        watched = self._watch(_Begun(loader, iterator, self._waits, fetches))
        if watched is None:
            return None
        generator = self._through(loader, watched)
        self._running = weakref.ref(generator)
        self._running_loader = weakref.ref(loader)
        return generator

    def _through(self, loader: Any, watched: Iterator[Any]) -> Iterator[Any]:
        before = self._steps()
        try:
            yield from watched
        finally:
            self._running = None
        if self._steps() == before:
            self._eval.add(loader)  # a whole pass without an optimizer step: evaluation


_ACCELERATE = "accelerate.data_loader"


def _when_imported(patches: PatchRegistry, name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` now if the module ``name`` is imported, else as it is imported (by the script,
    by transformers' Trainer...); the import hook is undone with ``patches``."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    hook = _AfterImport(name, then)
    sys.meta_path.insert(0, hook)
    patches.handle(hook)


class _Fetches:
    """The waits of ``fetcher``'s fetches in its pass, oldest first (``waits``, taken by ``tap.watch``
    as it hands each batch out); none kept once the pass is known unwatched."""

    def __init__(self, fetcher: Any) -> None:
        self.fetcher = fetcher
        self.waits: deque[float] = deque()
        self.kept = True

    def add(self, wait: float) -> None:
        if self.kept:
            self.waits.append(wait)


class _HandOuts:
    """A Lightning fetcher's hand-outs (its own ``__next__``), with the fetches they make timed beneath."""

    def __init__(self, loaders: LoaderWatch, fetches: _Fetches, fetcher: Any, hand_out: Callable[[Any], Any]) -> None:
        self._loaders = loaders
        self._fetches = fetches
        self._fetcher = fetcher
        self._hand_out = hand_out

    def __iter__(self) -> _HandOuts:
        return self

    def __next__(self) -> Any:
        loaders = self._loaders
        outer, loaders._beneath = loaders._beneath, self._fetches
        try:
            return self._hand_out(self._fetcher)
        finally:
            loaders._beneath = outer


class _Begun:
    """An iteration of ``loader`` the loop began (``iterator``, not yet advanced), for ``tap.watch``:
    ``batchtap_loader`` lets a loader that fetches ahead be timed beneath it, ``batchtap_waits``
    gets each batch's wait, ``batchtap_fetches`` (where not None) holds the waits of the fetches
    timed beneath the iterator, one per batch, oldest first. No length: the watch numbers what it is
    handed, as for any iterator."""

    def __init__(
        self, loader: object, iterator: Iterator[Any], waits: deque[float], fetches: deque[float] | None = None
    ) -> None:
        self.batchtap_loader = loader
        self.batchtap_waits = waits
        self.batchtap_fetches = fetches
        self._iterator = iterator

    def __iter__(self) -> Iterator[Any]:
        return self._iterator


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once the module ``name`` has run, wherever it is imported from; its
    ``remove()`` takes it off ``sys.meta_path`` (autolog's undo)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        finders = sys.meta_path
        after = finders[finders.index(self) + 1 :] if self in finders else list(finders)
        for finder in after:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenLoader(spec.loader, self.then)
                return spec
        return None

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _ThenLoader(importlib.abc.Loader):
    """The module's own loader, then ``then(module)``; anything else asked of it (``get_source``...)
    is the own loader's."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        created: ModuleType | None = self._loader.create_module(spec)
        return created

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:
        if name == "_loader":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)
