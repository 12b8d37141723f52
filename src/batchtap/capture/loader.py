"""Iterate a loader while timing the wait for each batch on the host clock.

A loader that fetches ahead of what it hands out (Accelerate's ``DataLoaderShard``, what
``accelerator.prepare(loader)`` returns: it fetches batch ``i + 1`` from its ``DataLoader`` before
handing out batch ``i``, to know which batch is the last) is timed beneath: each fetch of the
underlying ``DataLoader`` is timed and queued, and the batch it fetched gets that wait when it is
handed out, plus what the loader itself spent on it (moving it to the device). Timing the
``next()`` of the loader alone would give batch ``i`` the fetch of batch ``i + 1`` (the first batch
two fetches, the last none). Accelerate's ``DataLoaderDispatcher`` (``dispatch_batches=True``, the
default for an ``IterableDataset``) also fetches one batch ahead, in ``_fetch_batches``: the main
process fetches (``num_processes`` batches, or one with ``split_batches``) and every process waits
in its broadcast; each of its calls is timed and queued the same way.

An iterable whose fetches its maker times itself says so with ``batchtap_fetches``: a deque that
gets each fetch's wait, oldest first (autolog over Lightning's fetcher, which fetches one batch ahead
for a loader without a length). Its batches are handed the queued waits the same way.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from batchtap._fetches import timed_fetches

__all__ = ["look_ahead_base", "timed_batches"]

T = TypeVar("T")


def _beneath(loader: object) -> object:
    """The loader an already-begun iteration iterates (``batchtap_loader``), or ``loader`` itself.

    autolog hands ``tap.watch`` an iteration it saw begun (``iter(loader)`` was called by the loop):
    an iterable whose ``batchtap_loader`` is that loader, so a loader that fetches ahead is still
    timed beneath, and whose ``batchtap_waits`` (a deque) gets each batch's wait, for the
    micro-batch that trains on the batch.
    """
    return getattr(loader, "batchtap_loader", loader)


def _accelerate_kind(inner: object) -> str | None:
    kind = type(inner)  # type(), not __class__: Accelerate's adapter reports the DataLoader's class
    if kind.__name__ in ("DataLoaderShard", "DataLoaderDispatcher") and kind.__module__.startswith("accelerate."):
        return kind.__name__
    return None


def look_ahead_base(loader: object) -> torch.utils.data.DataLoader[Any] | None:
    """The ``DataLoader`` under a loader that fetches one batch ahead (Accelerate's
    ``DataLoaderShard``, which calls ``base_dataloader.__iter__()`` by name, or its
    ``DataLoaderDispatcher``), else None."""
    inner = _beneath(loader)
    if _accelerate_kind(inner) is None:
        return None
    base = getattr(inner, "base_dataloader", None)
    return base if isinstance(base, torch.utils.data.DataLoader) else None


def timed_batches(loader: Iterable[T], need_last: bool) -> Iterator[tuple[T, float, bool]]:
    """Yield ``(batch, seconds waited for it, is_last)``.

    ``is_last`` comes from ``len(loader)`` when the loader has one. Without a length it is only known
    by fetching one batch ahead, which is done only when ``need_last`` asks for it (sampling wants
    the last batch of an epoch); otherwise it is always False.

    Example:
        >>> [(b, last) for b, _, last in timed_batches([10, 20, 30], need_last=False)]
        [(10, False), (20, False), (30, True)]
        >>> [(b, last) for b, _, last in timed_batches(iter([1, 2]), need_last=True)]
        [(1, False), (2, True)]
    """
    try:
        total: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    waits: deque[float] | None = getattr(loader, "batchtap_waits", None)
    if waits is not None:
        for batch, waited, is_last in _timed(loader, need_last, total):
            waits.append(waited)
            yield batch, waited, is_last
    else:
        yield from _timed(loader, need_last, total)


def _timed(loader: Iterable[T], need_last: bool, total: int | None) -> Iterator[tuple[T, float, bool]]:
    base = look_ahead_base(loader)
    if base is not None:
        yield from _timed_beneath(loader, base, total)
        return
    fetches: deque[float] | None = getattr(loader, "batchtap_fetches", None)
    if fetches is not None:
        yield from _handed_out(iter(loader), fetches, total)
        return
    iterator = iter(loader)
    clock = time.perf_counter
    if total is not None or not need_last:
        index = 0
        while True:
            started = clock()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            waited = clock() - started
            yield batch, waited, total is not None and index == total - 1
            index += 1
    sentinel = object()
    started = clock()
    current: object = next(iterator, sentinel)
    waited = clock() - started
    while current is not sentinel:
        started = clock()
        following = next(iterator, sentinel)
        next_wait = clock() - started
        yield current, waited, following is sentinel  # type: ignore[misc]
        current, waited = following, next_wait


def _timed_beneath(
    loader: Iterable[T], base: torch.utils.data.DataLoader[Any], total: int | None
) -> Iterator[tuple[T, float, bool]]:
    """``timed_batches`` for a loader that fetches ahead from ``base``: batch ``i``'s wait is the
    fetch of batch ``i`` from ``base`` (a ``DataLoaderDispatcher``: its ``_fetch_batches`` call for
    batch ``i``, the main process's fetches or another process's wait for them) plus the time the
    loader's own ``next()`` spent on anything but fetches (moving the batch to the device); batches
    it skips (``skip_first_batches``) count as the first handed-out batch's wait."""
    clock = time.perf_counter
    waits: deque[float] = deque()  # fetches from base whose batches are not handed out yet
    inner = _beneath(loader)
    dispatcher = _accelerate_kind(inner) == "DataLoaderDispatcher"
    # a DataLoaderDispatcher fetches in its _fetch_batches (called by name), a DataLoaderShard through base.__iter__()
    target: Any = inner if dispatcher else base
    name = "_fetch_batches" if dispatcher else "__iter__"
    had = name in vars(target)
    previous = vars(target).get(name)  # an integration's own timing (BatchtapTrainer) stays beneath ours

    def __iter__() -> Iterator[Any]:
        return timed_fetches(previous() if previous is not None else type(base).__iter__(base), waits.append, clock)

    def _fetch_batches(iterator: Iterator[Any]) -> Any:
        started = clock()
        try:
            return previous(iterator) if previous is not None else type(inner)._fetch_batches(inner, iterator)  # type: ignore[attr-defined]
        finally:
            waits.append(clock() - started)

    setattr(target, name, _fetch_batches if dispatcher else __iter__)  # looked up by name on the instance
    try:
        iterator = iter(loader)
        yield from _handed_out(iterator, waits, total, skipped=int(getattr(_beneath(loader), "skip_batches", 0)))
    finally:
        if had:
            setattr(target, name, previous)
        else:
            delattr(target, name)


def _handed_out(
    iterator: Iterator[T], fetches: deque[float], total: int | None, *, skipped: int = 0
) -> Iterator[tuple[T, float, bool]]:
    """``timed_batches`` for an iterator whose fetches are timed beneath it into ``fetches`` (oldest
    first): batch ``i``'s wait is the fetch queued for it plus the time its ``next()`` spent on
    anything but fetches (moving it to the device); the fetches of ``skipped`` batches (Accelerate's
    ``skip_first_batches``) count as the first handed-out batch's wait."""
    clock = time.perf_counter
    index = 0
    while True:
        queued = len(fetches)
        started = clock()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        # the fetches this next() made are the ones queued during it (only this loop takes from the queue)
        own = clock() - started - sum(itertools.islice(fetches, queued, None))
        if index == 0:
            for _ in range(min(skipped, max(len(fetches) - 1, 0))):
                own += fetches.popleft()
        fetched = fetches.popleft() if fetches else 0.0
        yield batch, max(own, 0.0) + fetched, total is not None and index == total - 1
        index += 1
