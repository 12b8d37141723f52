"""The spawned side of ``tests/sinks/test_pickle.py``: sinks unpickled in this other process and
driven there, as the pipeline process of ``bt.Tap(pipeline="process")`` drives them."""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any

from batchtap.sinks.base import Sink

_SINKS: dict[int, Sink] = {}


def load(blob: bytes) -> int:
    """Unpickle a sink here; the key :func:`call` and :func:`attr` know it by."""
    key = len(_SINKS)
    _SINKS[key] = pickle.loads(blob)
    return key


def call(key: int, method: str, *args: Any) -> Any:
    return getattr(_SINKS[key], method)(*args)


def attr(key: int, name: str) -> Any:
    return getattr(_SINKS[key], name)


def with_own_std_streams(blob: bytes, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> tuple[str, str]:
    """Unpickle a sink while this process's ``sys.stdout``/``sys.stderr`` are buffers made here
    (nothing the pickling process could have sent), make ``calls`` on it, and return what each
    buffer got."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err = io.StringIO(), io.StringIO()
    try:
        sink = pickle.loads(blob)
        for method, args in calls:
            getattr(sink, method)(*args)
    finally:
        sys.stdout, sys.stderr = saved
    return out.getvalue(), err.getvalue()


def wandb_teardown() -> None:
    """Wait until this process's wandb service wrote every run file."""
    import wandb

    wandb.teardown()
