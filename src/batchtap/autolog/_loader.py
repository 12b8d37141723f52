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
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import DataLoader

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
        self.enabled = True

    def install(self, patches: PatchRegistry) -> None:
        self._watch_iterations(patches, DataLoader)
        module = sys.modules.get(_ACCELERATE)
        if module is not None:
            self._wrap_shard(patches, module)
        else:  # imported later (by the script, by transformers' Trainer): wrapped as it is imported
            hook = _AfterImport(_ACCELERATE, lambda m: self._wrap_shard(patches, m))
            sys.meta_path.insert(0, hook)
            patches.handle(hook)

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
                return loaders._watched(self, iterator)
            return iterator

        __iter__.__wrapped__ = original  # type: ignore[attr-defined]
        patches.replace(owner, "__iter__", __iter__)

    def _watched(self, loader: Any, iterator: Any) -> Any:
        running = self._running() if self._running is not None else None
        if running is not None and self._running_loader is not None and self._running_loader() is loader:
            running.close()  # the same loader again: its old pass was left suspended at its end
            running = None
        if running is not None or loader in self._eval:
            return iterator
        self._waits.clear()  # a new pass: waits of the last one's batches never trained on are not this one's
        watched = self._watch(_Begun(loader, iterator, self._waits))
        if watched is None:
            return iterator
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


class _Begun:
    """An iteration of ``loader`` the loop began (``iterator``, not yet advanced), for ``tap.watch``:
    ``batchtap_loader`` lets a loader that fetches ahead be timed beneath it, ``batchtap_waits``
    gets each batch's wait. No length: the watch numbers what it is handed, as for any iterator."""

    def __init__(self, loader: object, iterator: Iterator[Any], waits: deque[float]) -> None:
        self.batchtap_loader = loader
        self.batchtap_waits = waits
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
