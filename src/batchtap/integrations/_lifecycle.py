"""What the framework integrations share: ending a run the way the training ended."""

from __future__ import annotations

from batchtap.tap import Tap

__all__ = ["finish_as"]


def finish_as(tap: Tap, exc: BaseException | None) -> None:
    """End ``tap``'s run as ``exc`` ended training: ``finished`` without one, ``stopped`` on
    ``KeyboardInterrupt`` (as ``Tap.run()`` does), else ``failed`` with the exception as the reason."""
    if exc is None:
        tap.finish()
    elif isinstance(exc, KeyboardInterrupt):
        tap.finish("stopped", reason="KeyboardInterrupt")
    else:
        tap.finish("failed", reason=f"{type(exc).__name__}: {exc}")
