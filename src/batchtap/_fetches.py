"""Timing each fetch of an iterator: the one loop behind every measured loader wait.

``capture/loader.py`` (a watched loader, Accelerate's look-ahead loader beneath it) and the HF
Trainer integration (the ``DataLoader`` beneath the Trainer's) both time ``next()`` on an iterator
they do not own; the clock is passed in by the caller, so a test that replaces the clock in the
caller's module controls these readings too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["timed_fetches"]

T = TypeVar("T")


def timed_fetches(iterator: Iterator[T], record: Callable[[float], object], clock: Callable[[], float]) -> Iterator[T]:
    """``iterator``'s items, each ``next()``'s duration in seconds handed to ``record`` first.

    Example:
        >>> ticks = iter([0.0, 0.5, 1.0, 3.0, 4.0, 4.25])
        >>> waits = []
        >>> list(timed_fetches(iter("ab"), waits.append, lambda: next(ticks)))
        ['a', 'b']
        >>> waits  # the end of the iteration is not a fetch
        [0.5, 2.0]
    """
    while True:
        started = clock()
        try:
            item = next(iterator)
        except StopIteration:
            return
        record(clock() - started)
        yield item
