"""Shared pieces of the autolog tests: an autolog session per test that is always undone, and
host-read counting over whole training iterations (autolog on and off)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import batchtap as bt
from batchtap.autolog import active_session
from batchtap.hostreads import HostReadCounter
from tests.conftest import ListSink


@contextlib.contextmanager
def autologged(sink: ListSink, **kwargs: object) -> Iterator[bt.Tap]:
    """``bt.autolog(sinks=[sink])`` for the body; ended (and every patch undone) after it, even on failure."""
    tap = bt.autolog(sinks=[sink], flush_every=kwargs.pop("flush_every", 4), **kwargs)  # type: ignore[arg-type]
    assert tap is not None
    try:
        yield tap
    finally:
        bt.autolog(enabled=False)
        assert active_session() is None


class Reads:
    """Host reads per iteration, counted after the first (which builds the ring)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    @contextlib.contextmanager
    def iteration(self, index: int) -> Iterator[None]:
        if index == 0:
            yield
            return
        with HostReadCounter() as counter:
            yield
        self.counts.append(counter.count)
