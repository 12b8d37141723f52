"""The optimizer-step facts every front-end takes the same way: the metrics that take a value at
the optimizer step (gradient norm, loss scale, learning rate) and autolog use these, so the rules
for "this step's gradient norm" and "did the scaler skip" are written once.

Two facts of ``torch.optim.Optimizer``'s hook wrapper shape them: the ``args`` a hook gets start
with the optimizer itself (a closure is ``args[1]``), and an optimizer subclass whose ``step``
calls ``super().step()`` fires the hooks twice, nested. The post-hook never fires when ``step``
raises, so the nesting is told from the call stack, not from a counter a raise would leave stuck.
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from batchtap.metrics.functional import grads_norm

__all__ = [
    "ParameterStepListener",
    "StepListener",
    "StepNesting",
    "StepWatch",
    "TakeAtStep",
    "step_watch",
    "dtensor_type",
    "global_norm",
    "gradients_norm",
    "has_closure",
    "scaler_states",
    "scaler_stepped_since",
]


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


class StepListener(Protocol):
    """What listens to the outermost ``optimizer.step`` calls through :class:`StepWatch`."""

    def step_begins(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        """Before the step runs (its pre-hook): the gradients are the step's unless ``closure``."""

    def step_ends(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        """After it ran (its post-hook; never for a step that raised)."""


class StepWatch:
    """The one pair of global optimizer step hooks that every part of batchtap listens through:
    ``bt.Tap(optimizer=, model=, scaler=)``'s learning rate, gradient norm and loss scale, and
    autolog's steps. Only the outermost call of a nested ``step`` (``super().step()``) reaches the
    listeners, told once by one :class:`StepNesting`; listeners are held weakly (a metric that is
    gone stops listening), and torch's hooks are registered while anyone listens.

    Example:
        >>> class Seen:
        ...     def __init__(self): self.calls = []
        ...     def step_begins(self, optimizer, closure): self.calls.append(("begins", closure))
        ...     def step_ends(self, optimizer, closure): self.calls.append(("ends", closure))
        >>> seen = Seen(); handle = step_watch().listen(seen)
        >>> w = torch.nn.Parameter(torch.ones(1)); w.grad = torch.ones(1)
        >>> torch.optim.SGD([w], lr=0.1).step(); handle.remove(); seen.calls
        [('begins', False), ('ends', False)]
    """

    def __init__(self) -> None:
        self.nesting = StepNesting()
        self._listeners: list[weakref.ref[StepListener]] = []
        self._handles: tuple[Any, Any] | None = None
        self._closure = False

    def listen(self, listener: StepListener) -> _Listening:
        """Call ``listener`` at every outermost optimizer step from now on; ``.remove()`` the
        returned handle to stop (or let the listener be collected)."""
        if self._handles is None:
            self._handles = (register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post))
        ref = weakref.ref(listener, self._forget)
        self._listeners.append(ref)
        return _Listening(self, ref)

    def _forget(self, ref: weakref.ref[StepListener]) -> None:
        if ref in self._listeners:
            self._listeners.remove(ref)
        if not self._listeners and self._handles is not None:
            for handle in self._handles:  # nobody listens: every optimizer step is torch's own again
                handle.remove()
            self._handles = None
            self.nesting = StepNesting()

    def _pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.nesting.pre(sys._getframe(1)):
            return  # super().step() of a subclass, or an optimizer wrapping another
        self._closure = closure = has_closure(args, kwargs)
        for ref in list(self._listeners):
            listener = ref()
            if listener is not None:
                listener.step_begins(optimizer, closure)

    def _post(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.nesting.post():
            return
        closure = self._closure
        for ref in list(self._listeners):
            listener = ref()
            if listener is not None:
                listener.step_ends(optimizer, closure)


class _Listening:
    """A :meth:`StepWatch.listen` handle: ``remove()`` stops listening."""

    __slots__ = ("_watch", "_ref")

    def __init__(self, watch: StepWatch, ref: weakref.ref[StepListener]) -> None:
        self._watch, self._ref = watch, ref

    def remove(self) -> None:
        self._watch._forget(self._ref)


_M = TypeVar("_M")


class ParameterStepListener(Generic[_M]):
    """Base of a metric's listener to the optimizer steps that update any of its parameters.

    It holds its metric weakly (the step watch holds the listener weakly too, so both go with the
    metric) and remembers per optimizer whether it steps those parameters, checked again only when
    the optimizer's parameter groups change. Subclasses add ``step_begins`` / ``step_ends``.
    """

    __slots__ = ("metric", "ids", "owners", "closure", "handle", "__weakref__")

    def __init__(self, metric: _M, params: Iterable[torch.Tensor]) -> None:
        self.metric = weakref.ref(metric)
        self.ids = frozenset(id(p) for p in params)
        # optimizer -> (param groups when checked, whether it steps any of these parameters)
        self.owners: weakref.WeakKeyDictionary[object, tuple[int, bool]] = weakref.WeakKeyDictionary()
        self.closure: object | None = None  # the optimizer whose closure step is open
        self.handle = step_watch().listen(self)  # type: ignore[arg-type]  # subclasses are StepListeners

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps any of the parameters (a host check, cached)."""
        groups = optimizer.param_groups
        known = self.owners.get(optimizer)
        if known is None or known[0] != len(groups):
            ids = self.ids
            known = (len(groups), any(id(p) in ids for group in groups for p in group["params"]))
            self.owners[optimizer] = known
        return known[1]


class TakeAtStep(Generic[_M]):
    """A metric's listener that hands it each outermost optimizer step before the step runs:
    ``take(metric, optimizer)``. It holds its metric weakly (the step watch holds the listener
    weakly too, so both go with the metric); listen with ``step_watch().listen(...)``."""

    __slots__ = ("metric", "take", "__weakref__")

    def __init__(self, metric: _M, take: Callable[[_M, torch.optim.Optimizer], None]) -> None:
        self.metric = weakref.ref(metric)
        self.take = take

    def step_begins(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        metric = self.metric()
        if metric is not None:
            self.take(metric, optimizer)

    def step_ends(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        pass


_WATCH: StepWatch | None = None


def step_watch() -> StepWatch:
    """The process's :class:`StepWatch`."""
    global _WATCH
    if _WATCH is None:
        _WATCH = StepWatch()
    return _WATCH


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


def dtensor_type() -> type | None:
    """``DTensor`` when its module is loaded (a model with DTensor parameters loaded it), else None:
    nothing is imported here, so plain runs never pay for ``torch.distributed.tensor``."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        found = getattr(sys.modules.get(module), "DTensor", None)
        if isinstance(found, type):
            return found
    return None


def global_norm(norm: torch.Tensor) -> torch.Tensor:
    """A norm as a plain tensor holding the global value, whatever form a clipping call returned.

    ``clip_grad_norm_`` / ``get_total_norm`` of FSDP2 or tensor-parallel (``DTensor``) gradients
    return a ``DTensor``: replicated (every rank holds the global norm already: its local tensor,
    no communication) or, from a bare ``vector_norm``, partial (the ranks' parts still to combine:
    ``full_tensor()``, the same collective the loop's own ``.full_tensor()`` would run, on the
    device, no host read). A plain tensor is returned as it is.
    """
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(norm, dtensor):
        return norm
    if any(placement.is_partial() for placement in norm.placements):  # type: ignore[attr-defined]
        full: torch.Tensor = norm.full_tensor()  # type: ignore[attr-defined]
        return full
    local: torch.Tensor = norm.to_local()  # type: ignore[attr-defined]
    return local


def gradients_norm(grads: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The global L2 norm of ``grads`` together, as ``clip_grad_norm_`` computes it: 0-dim on
    ``device`` (default: the first gradient's), no host read.

    Plain gradients take :func:`~batchtap.metrics.functional.grads_norm` (a constant number of
    device ops). ``DTensor`` gradients (FSDP2's ``fully_shard``, tensor parallel) hold a shard
    each: their squared local norms are summed over the mesh on the device (torch's own
    ``get_total_norm`` of the DTensors, then one all-reduce), so every rank gets the global norm,
    never its shard's, and the value needs no further combining across ranks.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.full((4,), 2.0)
        >>> gradients_norm([w.grad])
        tensor(4.)
    """
    dtensor = dtensor_type()
    sharded = [g for g in grads if isinstance(g, dtensor)] if dtensor is not None else []
    if not sharded:
        return grads_norm(grads, device or grads[0].device)
    plain = [g for g in grads if not isinstance(g, dtensor)]  # type: ignore[arg-type]
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for g in sharded:
        by_mesh.setdefault(id(g.device_mesh), []).append(g)  # type: ignore[attr-defined]
    parts = [global_norm(torch.nn.utils.get_total_norm(group)) for group in by_mesh.values()]
    target = device or parts[0].device
    if plain:  # parameters FSDP left unsharded are replicated: their local norm is already global
        parts.append(grads_norm(plain, target))
    parts = [p.to(target, dtype=torch.float32, non_blocking=True) for p in parts]
    return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))
