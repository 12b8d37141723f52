"""Calls into a sink under a deadline: one helper thread per sink, so a hung call costs its caller
only ``call_timeout`` seconds (used by :class:`~batchtap.sinks.resilient.ResilientSink`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from batchtap.errors import SinkError

__all__ = ["CallThread", "SinkStalled"]


class SinkStalled(SinkError):
    """A call into a sink did not return within its deadline (or an earlier one still has not)."""


class CallThread:
    """Runs a sink's calls on one helper thread so that the caller can stop waiting for a hung one.

    A call that outlives its timeout keeps running on the helper thread (Python cannot abandon
    it); until it returns, further calls fail at once with :class:`SinkStalled`.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._cv = threading.Condition()
        self._job: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = None
        self.busy_since: float | None = None  # monotonic start of the call in progress
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> Any:
        """``fn(*args)`` on the helper thread; its result, or its exception raised here.

        Raises:
            SinkStalled: the call did not return within ``timeout`` seconds, or an earlier call
                still has not.
        """
        box: dict[str, Any] = {"done": threading.Event()}
        with self._cv:
            if self.busy_since is not None:
                raise SinkStalled(
                    f"sink {self.name} is still inside a call made {time.monotonic() - self.busy_since:.1f} s ago"
                )
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"batchtap-call-{self.name}", daemon=True)
                self._thread.start()
            self.busy_since = time.monotonic()
            self._job = (fn, args, box)
            self._cv.notify_all()
        if not box["done"].wait(timeout):
            raise SinkStalled(
                f"sink {self.name} did not return from {getattr(fn, '__name__', 'a call')}() within "
                f"call_timeout={timeout:g} s (hung: a server that stopped answering, a stuck disk)"
            )
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _loop(self) -> None:
        while True:
            with self._cv:
                # sync: the sink-call helper thread idles until a call arrives (no device involved)
                self._cv.wait_for(lambda: self._job is not None)
                assert self._job is not None
                fn, args, box = self._job
                self._job = None
            try:
                box["result"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                box["error"] = exc
            with self._cv:
                self.busy_since = None
            box["done"].set()
