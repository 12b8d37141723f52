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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from batchtap.autolog._patches import PatchRegistry

__all__ = ["LoaderWatch"]


class LoaderWatch:
    """Routes training-loader iterations through ``watch``.

    Args:
        watch: ``tap.watch``-like: takes an iterator, yields its items (None while no run is open).
        steps: how many optimizer steps have been seen so far.
    """

    def __init__(self, watch: Callable[[Any], Iterator[Any] | None], steps: Callable[[], int]) -> None:
        self._watch = watch
        self._steps = steps
        self._running: weakref.ref[Any] | None = None  # the watched iteration in progress
        self._running_loader: weakref.ref[DataLoader[Any]] | None = None  # the loader it iterates
        self._eval: weakref.WeakSet[DataLoader[Any]] = weakref.WeakSet()
        self.enabled = True

    def install(self, patches: PatchRegistry) -> None:
        original = DataLoader.__iter__
        loaders = self

        def __iter__(self: DataLoader[Any]) -> Any:
            iterator = original(self)
            if loaders.enabled and torch.is_grad_enabled() and not torch.compiler.is_compiling():
                return loaders._watched(self, iterator)
            return iterator

        __iter__.__wrapped__ = original  # type: ignore[attr-defined]
        patches.replace(DataLoader, "__iter__", __iter__)

    def _watched(self, loader: DataLoader[Any], iterator: Any) -> Any:
        running = self._running() if self._running is not None else None
        if running is not None and self._running_loader is not None and self._running_loader() is loader:
            running.close()  # the same loader again: its old pass was left suspended at its end
            running = None
        if running is not None or loader in self._eval:
            return iterator
        watched = self._watch(iterator)
        if watched is None:
            return iterator
        generator = self._through(loader, watched)
        self._running = weakref.ref(generator)
        self._running_loader = weakref.ref(loader)
        return generator

    def _through(self, loader: DataLoader[Any], watched: Iterator[Any]) -> Iterator[Any]:
        before = self._steps()
        try:
            yield from watched
        finally:
            self._running = None
        if self._steps() == before:
            self._eval.add(loader)  # a whole pass without an optimizer step: evaluation
