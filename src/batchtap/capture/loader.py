"""Iterate a loader while timing the wait for each batch on the host clock."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["timed_batches"]

T = TypeVar("T")


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
