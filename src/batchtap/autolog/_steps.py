"""What happens at each optimizer step, from PyTorch's own hooks.

The global optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` /
``_post_hook``) fire for every optimizer class, fused and foreach included, and for optimizers
made before they were registered. At the pre-hook the learning rate is the one the step uses,
wherever the loop calls ``scheduler.step()``; the gradients are the step's own (``zero_grad``
comes later). Three more seams complete the picture:

* clipping: ``clip_grad_norm_`` returns the norm *before* clipping, and
  ``clip_grads_with_norm_(params, max_norm, total_norm)`` (how Accelerate >= 1.x and so the HF
  Trainer clip, after ``get_total_norm``) is handed it: that pre-clip norm is the step's gradient
  norm for the optimizer holding those parameters (computed from the gradients otherwise, on the
  device; for FSDP2 / ``DTensor`` gradients summed over the mesh, the global norm on every rank);
* ``GradScaler.step``: a step the scaler skips fires no hook with a non-fused optimizer (the
  scaler decided on the host) but does with a fused one (the kernel skips on the device, the
  skip flag is the ``found_inf`` tensor handed to the optimizer); so the step is closed when
  ``GradScaler.step`` returns, with the scale its loss was multiplied by;
* Lightning's automatic optimization runs the forward and ``backward()`` *inside*
  ``optimizer.step(closure)``: with a closure, the gradient norm is taken in the post-hook.

An optimizer subclass whose ``step`` calls ``super().step()`` fires the hooks twice: only the
outermost pair counts (told from the call stack, so a ``step`` that raised, whose post-hook never
fired, does not hold later steps as nested). Nothing here reads a device value.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from batchtap.autolog._patches import PatchRegistry
from batchtap.metrics.optimizer_hooks import global_norm, gradients_norm, step_watch

__all__ = ["StepEvent", "OptimizerSteps"]


@dataclasses.dataclass(slots=True)
class StepEvent:
    """One optimizer step, as the hooks saw it.

    Attributes:
        optimizer: the optimizer that stepped (or that the scaler skipped).
        lrs: each param group's learning rate the step used.
        grad_norm: the step's gradient norm (0-dim device tensor), None when no gradient existed.
        skipped: None without a GradScaler; else 0.0 / 1.0 known on the host, or the fused
            optimizer's ``found_inf`` device tensor.
        scale: the GradScaler scale the step's loss was multiplied by (a device copy).
    """

    optimizer: torch.optim.Optimizer
    lrs: tuple[float, ...]
    grad_norm: torch.Tensor | None
    skipped: torch.Tensor | float | None = None
    scale: torch.Tensor | None = None


def learning_rates(optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    # A CPU tensor lr (capturable schedulers) is read without any device involvement.
    return tuple([float(group["lr"]) for group in optimizer.param_groups])


class OptimizerSteps:
    """Turns optimizer steps into :class:`StepEvent` s for ``on_step``.

    Args:
        on_step: called with each step's event (on the training thread).
        on_optimizer: called with each optimizer made (``Optimizer.__init__``) or first seen stepping.
        guard: ``guard(action, *args)`` runs ``action(*args)`` so that an error in it never reaches the
            user's loop.
    """

    def __init__(
        self,
        on_step: Callable[[StepEvent], None],
        on_optimizer: Callable[[torch.optim.Optimizer], None],
        guard: Callable[..., None],
    ) -> None:
        self._on_step = on_step
        self._on_optimizer = on_optimizer
        self._guard = guard
        self._open: _OpenStep | None = None
        # pre-clip norms of this step's clipping calls, by the ids of the parameters each clipped
        # (several models: each optimizer takes its own model's, never another's)
        self._clips: list[tuple[torch.Tensor, frozenset[int]]] = []
        self._scaler: weakref.ref[torch.amp.GradScaler] | None = None  # the GradScaler that last scaled a loss
        self._scaler_step: list[StepEvent] | None = None  # inside GradScaler.step: the hooks' event goes here
        self._params: weakref.WeakKeyDictionary[torch.optim.Optimizer, frozenset[int]] = weakref.WeakKeyDictionary()
        self._known: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._patches: PatchRegistry | None = None
        self._zero: Any = None  # inside a DeepSpeed ZeRO optimizer's step: that optimizer
        self._zero_patched: set[type] = set()
        self._last_ids: tuple[weakref.ref[torch.optim.Optimizer], frozenset[int]] | None = None
        #: the process's shared step watch (its ``nesting.depth`` is read at every backward())
        self.watch = step_watch()
        self.enabled = True

    def install(self, patches: PatchRegistry) -> None:
        self._patches = patches
        patches.handle(self.watch.listen(self))  # the hooks every batchtap part shares
        self._patch_init(patches)
        self._patch_clip(patches)
        self._patch_scaler(patches)

    # ------------------------------------------------------------------ optimizers

    def known(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._known:
            self._known.add(optimizer)
            if "deepspeed" in sys.modules:
                self._patch_zero()
            self._on_optimizer(optimizer)

    def _patch_zero(self) -> None:
        """DeepSpeed ZeRO wraps the torch optimizer and clips its flat gradient partitions itself,
        inside its own ``step``, before it steps the wrapped one: no clipping call to observe, and
        the gradients the wrapped step sees are clipped. Its pre-clip global norm of the step
        (``_global_grad_norm``, set before the wrapped step) is the step's norm. Patched when an
        optimizer is made with DeepSpeed loaded (``deepspeed.initialize`` makes the wrapped one)."""
        if self._patches is None:
            return
        steps = self
        for module_name, class_name in _ZERO_OPTIMIZERS:
            cls = getattr(sys.modules.get(module_name), class_name, None)
            if not isinstance(cls, type) or cls in self._zero_patched:
                continue
            self._zero_patched.add(cls)
            original = cls.step  # type: ignore[attr-defined]

            def step(wrapper: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
                outer, steps._zero = steps._zero, wrapper
                try:
                    return __original(wrapper, *args, **kwargs)
                finally:
                    steps._zero = outer

            step.__wrapped__ = original  # type: ignore[attr-defined]
            step.__doc__ = original.__doc__
            self._patches.replace(cls, "step", step)

    def _patch_init(self, patches: PatchRegistry) -> None:
        original = torch.optim.Optimizer.__init__
        steps = self

        def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if steps.enabled:
                steps._guard(lambda: steps.known(self))

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        patches.replace(torch.optim.Optimizer, "__init__", __init__)

    # ------------------------------------------------------------------ the step hooks

    def step_begins(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        """The outermost ``optimizer.step`` call's pre-hook (through the shared step watch)."""
        self._open = None  # an earlier step that raised left its step open: it is not recorded
        if not self.enabled or torch.compiler.is_compiling():
            return
        self._guard(self._begin, optimizer, closure)

    def _begin(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        self.known(optimizer)
        found_inf = getattr(optimizer, "found_inf", None)  # set by GradScaler.step for a fused optimizer
        grad_scale = getattr(optimizer, "grad_scale", None)
        open_step = _OpenStep(optimizer, learning_rates(optimizer), closure, found_inf)
        if not closure:  # the gradients are this step's: take the norm before the step runs
            open_step.grad_norm = self._norm(optimizer, grad_scale)
        self._open = open_step

    def step_ends(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        """The outermost call's post-hook (never for a step that raised)."""
        open_step, self._open = self._open, None
        if open_step is None or not self.enabled:
            return
        self._guard(self._end, open_step)

    def _end(self, open_step: _OpenStep) -> None:
        optimizer = open_step.optimizer
        if open_step.closure:  # the closure ran forward and backward inside the step
            open_step.grad_norm = self._norm(optimizer, None)
        event = StepEvent(optimizer, open_step.lrs, open_step.grad_norm)
        if self._scaler_step is not None:
            event.skipped = open_step.found_inf if open_step.found_inf is not None else 0.0
            self._scaler_step.append(event)  # GradScaler.step completes it with the scale
        else:
            self._on_step(event)

    def _norm(self, optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> torch.Tensor | None:
        """The pre-clip norm ``clip_grad_norm_`` returned for this optimizer's parameters, else the
        norm of its gradients (divided by the scale they still carry inside a fused scaler step)."""
        clipped = self._take_clip(optimizer)
        if clipped is not None:
            return clipped
        zero = self._zero
        if zero is not None and getattr(zero, "optimizer", None) is optimizer:
            norm = getattr(zero, "_global_grad_norm", None)  # ZeRO's pre-clip norm of this step
            if isinstance(norm, torch.Tensor):
                return norm.detach()
            if isinstance(norm, float):  # inf on an overflow (a host float already)
                return torch.tensor(norm)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return None
        norm = gradients_norm(grads)
        if isinstance(grad_scale, torch.Tensor):
            norm = norm / grad_scale.to(norm.device, non_blocking=True)
        return norm

    def _take_clip(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The pre-clip norm of a clipping call over this optimizer's parameters (and forget it)."""
        if not self._clips:
            return None
        ids = self._param_ids(optimizer)
        for i, (norm, clipped) in enumerate(self._clips):
            if not clipped.isdisjoint(ids):
                del self._clips[i]
                return norm
        return None

    def clear_clips(self) -> None:
        """A new ``backward()``: norms clipped before it belong to steps already taken (or never)."""
        if self._clips:
            self._clips.clear()

    def _record_clip(self, parameters: list[Any], norm: Any) -> None:
        if not self.enabled or not parameters or not isinstance(norm, torch.Tensor) or torch.compiler.is_compiling():
            return
        ids = frozenset(map(id, parameters))
        norm = global_norm(norm)  # FSDP2 / DTensor gradients: the global norm as a plain tensor
        if any(clipped == ids for _, clipped in self._clips):
            return  # clipped twice: the first call's norm is the pre-clip one
        self._clips.append((norm, ids))

    def _param_ids(self, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        last = self._last_ids  # the optimizer asked last (the usual loop has one): no weak-dict lookup
        if last is not None and last[0]() is optimizer:
            return last[1]
        ids = self._params.get(optimizer)
        if ids is None:
            ids = frozenset(id(p) for group in optimizer.param_groups for p in group["params"])
            self._params[optimizer] = ids
        self._last_ids = (weakref.ref(optimizer), ids)
        return ids

    # ------------------------------------------------------------------ clip_grad_norm_

    def _patch_clip(self, patches: PatchRegistry) -> None:
        import torch.nn.utils as utils
        import torch.nn.utils.clip_grad as clip_module

        original = clip_module.clip_grad_norm_
        steps = self

        def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            else:
                parameters = list(parameters)  # a generator would be used up by the original
            norm = original(parameters, *args, **kwargs)
            steps._record_clip(parameters, norm)
            return norm

        clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
        clip_grad_norm_.__doc__ = original.__doc__
        patches.replace(clip_module, "clip_grad_norm_", clip_grad_norm_)
        if getattr(utils, "clip_grad_norm_", None) is original:
            patches.replace(utils, "clip_grad_norm_", clip_grad_norm_)

        # get_total_norm + clip_grads_with_norm_: the norm handed to the clipping is the pre-clip one.
        # Only the public name is patched: torch's own clip_grad_norm_ calls the private function,
        # and its pre-clip norm is taken above.
        with_norm = getattr(utils, "clip_grads_with_norm_", None)
        if with_norm is None:
            return

        def clip_grads_with_norm_(
            parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: Any, total_norm: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            else:
                parameters = list(parameters)
            steps._record_clip(parameters, total_norm)
            return with_norm(parameters, max_norm, total_norm, *args, **kwargs)

        clip_grads_with_norm_.__wrapped__ = with_norm  # type: ignore[attr-defined]
        clip_grads_with_norm_.__doc__ = with_norm.__doc__
        patches.replace(utils, "clip_grads_with_norm_", clip_grads_with_norm_)

    # ------------------------------------------------------------------ GradScaler

    def _patch_scaler(self, patches: PatchRegistry) -> None:
        scaler_type = torch.amp.GradScaler
        original = scaler_type.step
        steps = self

        def step(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not steps.enabled or not scaler.is_enabled() or steps._scaler_step is not None:
                return original(scaler, optimizer, *args, **kwargs)
            lrs = learning_rates(optimizer)  # what a skipped step would have used
            events: list[StepEvent] = []
            steps._scaler_step = events
            try:
                result = original(scaler, optimizer, *args, **kwargs)
            finally:
                steps._scaler_step = None
            steps._guard(lambda: steps._scaler_done(scaler, optimizer, lrs, events))
            return result

        step.__wrapped__ = original  # type: ignore[attr-defined]
        step.__doc__ = original.__doc__
        patches.replace(scaler_type, "step", step)

        original_scale = scaler_type.scale

        def scale(scaler: torch.amp.GradScaler, outputs: Any) -> Any:
            if steps.enabled and scaler.is_enabled():
                steps._scaler = weakref.ref(scaler)  # its scale is a factor to undo, not a loss weight
            return original_scale(scaler, outputs)

        scale.__wrapped__ = original_scale  # type: ignore[attr-defined]
        scale.__doc__ = original_scale.__doc__
        patches.replace(scaler_type, "scale", scale)

    def raised(self) -> bool:
        """Whether an optimizer step raised since the last check (it is still open but no longer on
        the stack: its post-hook never came); called at each ``backward()``. Closes it."""
        nesting = self.watch.nesting
        if not nesting.depth:  # no step open (the usual backward()): no frame to look at
            return False
        if not nesting.stale(sys._getframe(1)):
            return False
        self._open = None
        return True

    def loss_scale(self) -> torch.Tensor | None:
        """The scale tensor of the GradScaler that last scaled a loss (None without one)."""
        scaler = self._scaler() if self._scaler is not None else None
        return getattr(scaler, "_scale", None) if scaler is not None else None

    def _scaler_done(
        self,
        scaler: torch.amp.GradScaler,
        optimizer: torch.optim.Optimizer,
        lrs: tuple[float, ...],
        events: list[StepEvent],
    ) -> None:
        if events:
            event = events[-1]
        else:  # no hook fired: the scaler found inf/NaN gradients and skipped optimizer.step()
            self.known(optimizer)
            event = StepEvent(optimizer, lrs, self._take_clip(optimizer), skipped=1.0)
        scale = scaler._scale
        # the scale this step's loss was multiplied by; update() changes it in place later
        event.scale = scale.clone() if isinstance(scale, torch.Tensor) else None
        self._on_step(event)


#: DeepSpeed's ZeRO optimizers (module, class): they clip inside their own step
_ZERO_OPTIMIZERS = (
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
)


@dataclasses.dataclass(slots=True)
class _OpenStep:
    optimizer: torch.optim.Optimizer
    lrs: tuple[float, ...]
    closure: bool
    found_inf: torch.Tensor | None
    grad_norm: torch.Tensor | None = None
