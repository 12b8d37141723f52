"""``bt.autolog()``: per-batch metrics of an unmodified PyTorch training script.

One line at the top of a script, no other edit: every optimizer step becomes one record with the
loss (the tensor given to ``backward()``, its division by an accumulation count and its
``GradScaler`` scale undone, read from the autograd graph), accuracy (where ``F.cross_entropy``,
``nn.CrossEntropyLoss`` or ``F.nll_loss`` saw logits and class targets), the learning rate the
step used, the gradient norm before clipping, step time, the ``DataLoader``'s wait, throughput,
and the AMP loss scale and skips. Nothing reads a device value per step.

Example:
    >>> import torch, batchtap as bt
    >>> tap = bt.autolog(sinks=[], name="doctest")
    >>> model = torch.nn.Linear(4, 3)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> for _ in range(5):
    ...     x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    ...     loss = torch.nn.functional.cross_entropy(model(x), y)
    ...     opt.zero_grad(); loss.backward(); opt.step()
    >>> bt.autolog(enabled=False)  # ends the run and undoes every patch (so does leaving the process)
    >>> tap.steps_recorded
    5
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

import torch

from batchtap.autolog._session import Session
from batchtap.rules.engine import RuleLike
from batchtap.sinks.base import Sink
from batchtap.tap import Tap

__all__ = ["autolog", "active_session"]

_ACTIVE: Session | None = None


def autolog(
    enabled: bool = True,
    *,
    name: str | None = None,
    config: Any = None,
    sinks: Sequence[Sink] | None = None,
    rules: Sequence[RuleLike] = (),
    optimizers: Sequence[torch.optim.Optimizer] = (),
    flush_every: int = 50,
    flush_seconds: float = 1.0,
    layers: int | None = None,
) -> Tap | None:
    """Record every optimizer step of this process from here on, with no other edit.

    Args:
        enabled: False ends the active autolog run (as ``finished``), undoes every patch and
            returns None. Leaving the process does the same: ``failed`` after an uncaught
            exception or ``sys.exit(n)`` with ``n != 0``, ``stopped`` after Ctrl-C or SIGTERM (then
            the process ends by SIGTERM, as it would without batchtap).
        name: the run's name (default: the script's name).
        config: stored with the run (a mapping, ``argparse.Namespace`` or dataclass).
        sinks: where records go (default: SQLite at ``$BATCHTAP_DB`` and the console).
        rules: anomaly rules, as for :class:`~batchtap.Tap`.
        optimizers: optimizers made before this call, in the order their values are named
            (``lr``, ``lr_1``...); optimizers made afterwards are found by themselves.
        flush_every: rows per flush, as for :class:`~batchtap.Tap`.
        flush_seconds: seconds between flushes, as for :class:`~batchtap.Tap`.
        layers: record per-layer ``grad_norm/<layer>``, ``weight_norm/<layer>`` and
            ``update_ratio/<layer>`` every ``layers``-th optimizer step
            (:class:`~batchtap.metrics.Layers`; the model is found from the first optimizer's
            parameters). None: not recorded.

    Returns:
        the Tap (its ``log()``, rules and sinks work as usual); None for ``enabled=False``.

    Under ``torchrun`` the run starts when the script has made its process group (at its first
    optimizer), so the ranks' rows are reduced as with an explicit Tap.

    A process that ``multiprocessing`` starts with ``spawn`` or ``forkserver`` (a ``DataLoader``
    worker with ``multiprocessing_context="spawn"``) runs the script's top level again as
    ``__mp_main__``: there ``autolog()`` does nothing and returns None, so no worker starts a run.
    """
    global _ACTIVE
    if _in_reimported_main():
        return None
    if not enabled:
        session, _ACTIVE = _ACTIVE, None
        if session is not None:
            session.end()
        return None
    if _ACTIVE is not None and not _ACTIVE.ended:
        _ACTIVE.say("twice", "bt.autolog() was called again while on: the first call's Tap keeps recording")
        return _ACTIVE.tap
    session = Session(
        name=name or _script_name(),
        config=config,
        sinks=sinks,
        rules=rules,
        flush_every=flush_every,
        flush_seconds=flush_seconds,
        optimizers=optimizers,
        layers=layers,
    )
    session.install()
    _ACTIVE = session
    return session.tap


def _in_reimported_main() -> bool:
    """Whether autolog() is called by the main script re-run as ``__mp_main__`` in a child process."""
    if "__mp_main__" not in sys.modules:  # only multiprocessing's children re-run the main module
        return False
    # the top level of the re-run main module is on the stack (a function defined there and called
    # later, as torch.multiprocessing.spawn calls its ranks', is a training process: not skipped)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


def active_session() -> Session | None:
    """The autolog session in force, if any (``batchtap run`` ends it with the script's status)."""
    return _ACTIVE if _ACTIVE is not None and not _ACTIVE.ended else None


def _script_name() -> str | None:
    from pathlib import Path

    main = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c") else None
    return Path(main).stem if main else None


class _CallableModule(types.ModuleType):
    """``bt.autolog(...)`` works whether ``bt.autolog`` is this function or this package (importing
    ``batchtap.autolog`` binds the package to that name in ``batchtap``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tap | None:
        return autolog(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
