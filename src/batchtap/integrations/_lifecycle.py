"""What the framework integrations share: ending a run the way the training ended."""

from __future__ import annotations

from batchtap._exit import Terminated
from batchtap.tap import Tap

__all__ = ["finish_as"]


def finish_as(tap: Tap, exc: BaseException | None) -> None:
    """End ``tap``'s run as ``exc`` ended training: ``finished`` without one (or ``sys.exit(0)``),
    ``stopped`` on ``KeyboardInterrupt`` or SIGTERM (as ``Tap.run()`` does), else ``failed`` with the
    exception (or the non-zero exit status) as the reason."""
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (None, 0)):
        tap.finish()
    elif isinstance(exc, KeyboardInterrupt):
        tap.finish("stopped", reason="KeyboardInterrupt")
    elif isinstance(exc, Terminated):
        tap.finish("stopped", reason="SIGTERM")
    elif isinstance(exc, SystemExit):
        tap.finish("failed", reason=f"the process exited with status {exc.code}")
    else:
        tap.finish("failed", reason=f"{type(exc).__name__}: {exc}")
