"""How a run ends when the process does: SIGTERM inside a run, and runs left open at exit.

SIGTERM (what SLURM, Kubernetes and ``kill`` send) becomes :class:`Terminated`, raised in the
training thread, so ``run()`` stores every captured step before the process ends the way SIGTERM
ends it. Where nothing catches it (``tap.start()`` in a script, ``bt.autolog()``), no traceback is
printed for it, the open run is stored ``stopped`` at exit, and the process then ends by SIGTERM
(status -15, as without batchtap). At interpreter exit, every Tap registered here has its open run
ended (``failed``, or ``stopped`` after SIGTERM; bounded by its ``exit_timeout``) before
multiprocessing's own exit handler terminates pipeline processes.
"""

from __future__ import annotations

import atexit
import multiprocessing.util  # noqa: F401  (imported first, so its exit handler is registered before ours)
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from batchtap.records import RunStatus

__all__ = ["Terminated", "catch_sigterm", "ending_of", "sigterm_received", "ExitRegistry", "AT_EXIT"]

# set once SIGTERM reached one of our handlers: the process is to end as SIGTERM ends it
_SIGTERM = threading.Event()


class Terminated(BaseException):
    """SIGTERM arrived inside ``run()`` (a BaseException, like KeyboardInterrupt, so training code's
    ``except Exception`` does not swallow it)."""


def catch_sigterm(enabled: bool) -> Any:
    """Turn SIGTERM into :class:`Terminated` for a run; returns the handler it replaced (None when
    not installed: ``enabled`` is False, or this is not the main thread, where handlers cannot be set)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        return None

    def on_sigterm(signum: int, frame: object) -> None:
        _SIGTERM.set()
        raise Terminated()

    if not isinstance(sys.excepthook, _QuietTerminated):
        sys.excepthook = _QuietTerminated(sys.excepthook)
    return signal.signal(signal.SIGTERM, on_sigterm)


def sigterm_received() -> bool:
    """Whether SIGTERM reached a handler of ours in this process (the run ends as ``stopped``)."""
    return _SIGTERM.is_set()


def ending_of(error: BaseException | None) -> tuple[RunStatus, str | None]:
    """How a run ends when ``error`` leaves the block around it (None: the block ended normally):
    ``stopped`` by SIGTERM or Ctrl-C, ``failed`` with the exception by anything else."""
    if error is None:
        return RunStatus.FINISHED, None
    if isinstance(error, Terminated):
        return RunStatus.STOPPED, "SIGTERM"
    if isinstance(error, KeyboardInterrupt):
        return RunStatus.STOPPED, "KeyboardInterrupt"
    return RunStatus.FAILED, f"{type(error).__name__}: {error}"


class _QuietTerminated:
    """``sys.excepthook`` that prints one line, not a traceback, for a :class:`Terminated` nothing
    caught (the process is about to end by SIGTERM; the traceback would only say where it was)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, Terminated):
            print("batchtap: SIGTERM: storing the run as stopped, then ending as SIGTERM would", file=sys.stderr)
            return
        self.previous(kind, value, tb)


def _end_as_sigterm() -> None:
    """After every run was stored: end the process the way SIGTERM would have without us."""
    if _SIGTERM.is_set():
        sys.stderr.flush()
        sys.stdout.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


class ExitRegistry:
    """Objects to end at interpreter exit, each by a method of its own.

    Every registered object is held weakly; one with an open run is also held strongly
    (:meth:`running`), so a script that drops its last reference to a Tap mid-run (an exception
    unwinding the frame that held it) still has that run ended. Running ones end first.
    """

    def __init__(self) -> None:
        self._all: weakref.WeakKeyDictionary[object, Callable[[object], None]] = weakref.WeakKeyDictionary()
        self._running: dict[int, object] = {}

    def register(self, obj: object, end: Callable[[Any], None]) -> None:
        """End ``obj`` at exit with ``end(obj)`` (an unbound method: the registry keeps no strong reference)."""
        self._all[obj] = end

    def running(self, obj: object, is_running: bool) -> None:
        """``obj`` opened (True) or ended (False) a run."""
        if is_running:
            self._running[id(obj)] = obj
        else:
            self._running.pop(id(obj), None)

    def end_all(self) -> None:
        first = list(self._running.values())
        rest = [obj for obj in list(self._all.keys()) if id(obj) not in self._running]
        try:
            for obj in first + rest:
                end = self._all.get(obj)
                if end is not None:
                    end(obj)
        finally:
            _end_as_sigterm()


#: the process's registry; its handler runs before multiprocessing's (registered after it)
AT_EXIT = ExitRegistry()
atexit.register(AT_EXIT.end_all)
