"""Helpers for PyTorch's optimizer step hooks, shared by the metrics that take a value at the
optimizer step (gradient norm, loss scale) and by autolog.

Two facts of ``torch.optim.Optimizer``'s hook wrapper shape them: the ``args`` a hook gets start
with the optimizer itself (a closure is ``args[1]``), and an optimizer subclass whose ``step``
calls ``super().step()`` fires the hooks twice, nested. The post-hook never fires when ``step``
raises, so the nesting is told from the call stack, not from a counter a raise would leave stuck.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["StepNesting", "has_closure", "scaler_states", "scaler_stepped_since"]


def has_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an ``optimizer.step`` call got a closure (hook ``args`` are ``(optimizer, *step_args)``).

    Example:
        >>> has_closure((object(),), {}), has_closure((object(), lambda: 0.0), {}), has_closure((None,), {"closure": None})
        (False, True, False)
    """
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    return closure is not None


class StepNesting:
    """Tells the outermost ``optimizer.step`` call's hooks from nested ones (``super().step()``).

    ``pre`` is given the frame that called the pre-hook (the optimizer's hook wrapper of that
    call). While an outer call's frame is still on the stack, a later pre-hook is nested; once it
    is not (its ``step`` raised, so its post-hook never fired), the next pre-hook starts afresh.
    The stack is walked only when a call is open (nested steps, or after a raise): an ordinary
    step costs a counter and a frame reference.

    Example:
        >>> import sys
        >>> nesting = StepNesting()
        >>> nesting.pre(sys._getframe()), nesting.pre(sys._getframe()), nesting.post(), nesting.post()
        (True, False, False, True)
        >>> def raising_step():
        ...     nesting.pre(sys._getframe())  # the post-hook never comes
        ...     raise RuntimeError
        >>> try:
        ...     raising_step()
        ... except RuntimeError:
        ...     pass
        >>> nesting.pre(sys._getframe())  # the raised call is no longer on the stack
        True
    """

    __slots__ = ("depth", "_outer", "recovered")

    def __init__(self) -> None:
        self.depth = 0
        self._outer: types.FrameType | None = None
        #: how many times an open call was found gone from the stack (a step that raised)
        self.recovered = 0

    def pre(self, caller: types.FrameType) -> bool:
        """A pre-hook fired from ``caller``: True when it belongs to the outermost call."""
        if self.depth:
            if _on_stack(self._outer, caller):
                self.depth += 1
                return False
            self.recovered += 1  # the earlier call raised: its post-hook never fired
        self.depth = 1
        self._outer = caller
        return True

    def stale(self, here: types.FrameType) -> bool:
        """Whether a call is open that is no longer on the stack seen from ``here`` (its ``step``
        raised); such a call is closed. Costs a compare when no call is open."""
        if not self.depth or _on_stack(self._outer, here):
            return False
        self.depth = 0
        self._outer = None
        self.recovered += 1
        return True

    def post(self) -> bool:
        """A post-hook fired: True when it closes the outermost call."""
        if not self.depth:
            return False
        self.depth -= 1
        if self.depth:
            return False
        self._outer = None
        return True


def _on_stack(frame: types.FrameType | None, start: types.FrameType) -> bool:
    if frame is None:
        return False
    walk: types.FrameType | None = start
    while walk is not None:
        if walk is frame:
            return True
        walk = walk.f_back
    return False


def scaler_states(scaler: Any) -> object:
    """The GradScaler's per-optimizer states object (``update()`` replaces it), or None."""
    if scaler is None or not scaler.is_enabled():
        return None
    return getattr(scaler, "_per_optimizer_states", None)


def scaler_stepped_since(scaler: Any, states: object) -> bool:
    """Whether ``scaler`` stepped since ``states`` was :func:`scaler_states`: ``step`` ran and
    ``update()`` did not yet, or ``update()`` replaced the states.
    Host state only. A step the scaler skipped fires no optimizer hook: this is how it shows.

    Example:
        >>> import torch
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> before = scaler_states(scaler)
        >>> w = torch.nn.Parameter(torch.ones(1)); opt = torch.optim.SGD([w], lr=0.1)
        >>> scaler.scale((w * float("inf")).sum()).backward()
        >>> scaler.unscale_(opt); scaler_stepped_since(scaler, before)  # unscaled to clip: not stepped yet
        False
        >>> scaler.step(opt); scaler_stepped_since(scaler, before)  # skipped: no optimizer hook fired
        True
        >>> scaler.update(); scaler_stepped_since(scaler, before)
        True
    """
    now = scaler_states(scaler)
    if now is None:
        return False
    if now is not states:
        return True
    # STEPPED: step() ran (a skipped one included); UNSCALED alone (unscale_ before clipping) is before the step
    return any(getattr(state.get("stage"), "name", None) == "STEPPED" for state in now.values())  # type: ignore[attr-defined]
