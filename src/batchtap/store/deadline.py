"""A deadline for blocking network calls that have none of their own.

psycopg's synchronous calls wait on the socket without a timeout: a server that keeps the TCP
connection open but never answers (a dead NAT entry, a paused VM, a failover) would block the
caller forever. :class:`Watchdog` runs one helper thread; while a call is armed and its deadline
passes, it runs the expiry action (for PostgreSQL: shut the socket down, which makes the blocked
read return at once with an error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Watchdog"]


class Watchdog:
    """Runs ``on_expire`` when an armed call outlives its deadline.

    Example:
        >>> import threading
        >>> fired = threading.Event()
        >>> dog = Watchdog("doctest")
        >>> with dog.armed(0.01, fired.set):
        ...     _ = fired.wait(5)
        >>> fired.is_set(), dog.expired
        (True, True)
        >>> dog.close()
    """

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._action: Callable[[], None] | None = None
        self._closed = False
        #: whether the latest armed call ran past its deadline
        self.expired = False
        self._thread = threading.Thread(target=self._loop, name=f"batchtap-watchdog-{name}", daemon=True)
        self._thread.start()

    @contextmanager
    def armed(self, seconds: float, on_expire: Callable[[], None]) -> Iterator[None]:
        """Arm for the body of the ``with`` block."""
        with self._cv:
            self.expired = False
            self._deadline = time.monotonic() + seconds
            self._action = on_expire
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                self._deadline = None
                self._action = None
                self._cv.notify_all()

    def _loop(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                action, self._action, self._deadline = self._action, None, None
                self.expired = True
                if action is not None:
                    try:
                        action()
                    except Exception:  # noqa: BLE001 - the expiry action is best effort
                        pass

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
