"""One training thread per run: a second thread calling ``step()`` is refused at its first call.

A run's ring rows, step counter and flusher belong to the thread that drives the loop; calls from
two threads would interleave rows and lose steps silently. Checking costs one thread-id read per
call.
"""

from __future__ import annotations

import threading

from batchtap.errors import RunStateError

__all__ = ["ThreadOwner"]


class ThreadOwner:
    """Remembers the first thread that calls in, and refuses any other.

    Example:
        >>> owner = ThreadOwner()
        >>> owner.check("step()")  # the first caller owns the run
        >>> refused = []
        >>> def other():
        ...     try:
        ...         owner.check("step()")
        ...     except RunStateError as exc:
        ...         refused.append(type(exc).__name__)
        >>> t = threading.Thread(target=other, name="other")
        >>> t.start(); t.join()
        >>> refused
        ['RunStateError']
    """

    __slots__ = ("ident", "name")

    def __init__(self) -> None:
        self.ident: int | None = None
        self.name = ""

    def check(self, what: str) -> None:
        me = threading.get_ident()
        if me == self.ident:
            return
        if self.ident is None:
            self.ident, self.name = me, threading.current_thread().name
            return
        raise RunStateError(
            f"{what} was called from thread {threading.current_thread().name!r}, but this run is driven by "
            f"thread {self.name!r}; expected every step()/accumulate()/log() of a run from one thread (calls "
            "from several threads would interleave and lose steps); fix: call them from the training thread "
            "only, or give each thread its own Tap"
        )
