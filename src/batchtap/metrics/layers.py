"""Per-layer signals of the optimizer step: each module's gradient norm, weight norm and update ratio.

When a run goes wrong the next question after "is the loss fine" is *where*: which layer's
gradients exploded, which one stopped learning. :class:`Layers` answers it on the device, with no
host read, every ``every``-th optimizer step, and carries the values in the ring like any other
metric (names ``grad_norm/<module path>``, ``weight_norm/<module path>``,
``update_ratio/<module path>``, so stores, exports, rules and the browser view can group them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch

from batchtap.errors import ConfigError
from batchtap.metrics._shared import step_device
from batchtap.metrics.base import Metric, RowWriter, StepInputs
from batchtap.metrics.domain import NONNEGATIVE, Output, Reduce
from batchtap.metrics.functional import _foreach_norm_fp32
from batchtap.metrics.gradients import _check_scaler, _scale_carried
from batchtap.metrics.layer_decoders import CAPTURED, NOT_CAPTURED, LayersDecoding
from batchtap.metrics.layer_sharding import MeshParts
from batchtap.metrics.optimizer_hooks import ParameterStepListener, step_watch

__all__ = ["Layers", "layer_groups", "find_model"]

#: the three per-layer values, in the order of their columns
KINDS = ("grad_norm", "weight_norm", "update_ratio")

# Layers' first host column: whether this row carries a capture
_NOT_CAPTURED, _CAPTURED = NOT_CAPTURED, CAPTURED


def layer_groups(model: torch.nn.Module, depth: int = 1) -> dict[str, list[torch.nn.Parameter]]:
    """The model's trainable parameters grouped by the module path cut at ``depth`` components.

    A parameter of a module shallower than ``depth`` belongs to that module; a parameter held by the
    root itself (``model.pos_emb``) is a group of its own, named by the parameter. Groups come in
    the order of ``named_parameters()``; a tied parameter counts once, in its first group.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(3, 1)))
        >>> {k: len(v) for k, v in layer_groups(net).items()}
        {'0': 2, '2': 2}
        >>> list(layer_groups(net, depth=2))
        ['0', '2.0']
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ConfigError(f"Layers depth must be an int >= 1, got {depth!r}; fix: depth=1 (top-level modules)")
    groups: dict[str, list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue  # frozen: no gradient, no update
        parts = name.split(".")
        module = parts[:-1]
        key = ".".join(module[:depth]) if module else name
        groups.setdefault(key, []).append(param)
    return groups


def _is_module(obj: object) -> bool:
    try:
        return isinstance(obj, torch.nn.Module)
    except ReferenceError:  # a weakref.proxy whose object is gone (the collector still lists it)
        return False


def find_model(params: Sequence[torch.Tensor]) -> torch.nn.Module | None:
    """The module that holds most of ``params`` among the program's root modules (found once by
    walking the garbage collector's objects: for ``bt.autolog``, which sees optimizers, not models).
    A ``DistributedDataParallel``-style wrapper (``.module``) is unwrapped, so layers keep the
    model's own names.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> find_model(list(net.parameters())) is net
        True
    """
    import gc
    import warnings

    wanted = {id(p) for p in params}
    with warnings.catch_warnings():  # isinstance() on a deprecated alias object warns (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if _is_module(o)]
    children = {id(c) for m in modules for c in m.children()}
    best: tuple[int, torch.nn.Module] | None = None
    for module in modules:
        if id(module) in children:
            continue
        held = sum(1 for p in module.parameters() if id(p) in wanted)
        if held and (best is None or held > best[0]):
            best = (held, module)
    if best is None:
        return None
    model = best[1]
    inner = getattr(model, "module", None)  # DistributedDataParallel, DataParallel
    if isinstance(inner, torch.nn.Module):
        model = inner
    inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper
    return inner if isinstance(inner, torch.nn.Module) else model


class Layers(LayersDecoding, Metric):
    """Per-module gradient norm, weight norm and update ratio, every ``every``-th optimizer step.

    For each module at ``depth`` (the model's top-level children by default) that has trainable
    parameters, on every ``every``-th optimizer step:

    * ``grad_norm/<path>``: L2 norm of the module's gradients as the optimizer step used them
      (before the step, so after any clipping the loop did; under AMP with ``scaler=`` the
      *unscaled* gradients; under DDP the all-reduced, so global, gradients; under FSDP2
      the shards' squares summed over the mesh, so global too);
    * ``weight_norm/<path>``: L2 norm of the module's parameters after the step;
    * ``update_ratio/<path>``: ``‖w_after − w_before‖ / ‖w_before‖`` — near 0 for a layer that
      stopped learning, large for one that is blowing up (1e-3 is a common healthy scale for Adam).

    Everything runs on the device in a constant number of fused ops however many parameters there
    are (``torch._foreach_norm`` per tensor, one matrix product to sum them per module), accumulated
    in float32: the gradient and weight-before norms and a copy of the weights in the optimizer's
    step pre-hook, the rest when ``tap.step`` writes the row. No host read. On steps that do not
    capture nothing runs on the device and the values are left out of the record.

    Which rows capture: the row of an optimizer step whose number (counted from 0 at the run's
    first row) is a multiple of ``every``, so step 0 is captured. The values are those of the latest
    optimizer step before the row: with ``tap.step`` after ``optimizer.step`` (the usual place,
    and where ``bt.autolog`` puts it) that is the row's own step; with ``tap.step`` before it they
    show at the next captured row. A step the ``GradScaler`` skipped runs no optimizer step and
    captures nothing.

    Memory: the update ratio needs the weights from before the step, so one copy of the trainable
    parameters is held on their device (allocated at the first capture).

    Args:
        model: the module whose parameters to watch; None: given later with :meth:`attach`, before
            the run's first row (what ``bt.autolog(layers=N)`` does once it found the model).
        every: capture every ``every``-th optimizer step (>= 1).
        depth: how many components of the module path name a layer (1: top-level children).
        scaler: the AMP ``GradScaler`` the loop uses; gradients it has not unscaled yet (a fused
            optimizer unscales inside its kernel) are divided by its scale on the device.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> layers = Layers(model, every=1)
        >>> [o.name for o in layers.outputs()]
        ['grad_norm/0', 'grad_norm/2', 'weight_norm/0', 'weight_norm/2', 'update_ratio/0', 'update_ratio/2']
        >>> model(torch.randn(5, 3)).pow(2).mean().backward()
        >>> opt.step()  # the pre-hook takes the gradient norms and the weights before the step
        >>> from batchtap.metrics.decoding import StepTiming
        >>> inputs = StepInputs(None, None, None, 5.0)
        >>> raw = [float(v) for v in layers.compute(inputs)] + list(layers.read_host(inputs))
        >>> values = layers.finalize(raw, StepTiming(5.0, 0.1, math.nan))
        >>> abs(values[2] - model[0].weight.detach().norm().hypot(model[0].bias.detach().norm()).item()) < 1e-6
        True
    """

    gradient_based: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module | None,
        *,
        every: int = 10,
        depth: int = 1,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"Layers needs the model (a torch.nn.Module), got {type(model).__name__}; fix: bt.metrics.Layers(model)"
            )
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"Layers every must be an int >= 1, got {every!r}; fix: e.g. every=10")
        if scaler is not None:
            _check_scaler(scaler, "Layers")
        self.every = every
        self.depth = depth
        self.scaler = scaler
        self.names: tuple[str, ...] = ()
        self.parameters: list[torch.Tensor] = []
        #: the layer index of each parameter, in the order of :attr:`parameters`
        self.owners: tuple[int, ...] = ()
        self.device_width = 0
        self.host_width = 1
        self._outputs: tuple[Output, ...] = ()
        self._not_captured: tuple[float, ...] = (_NOT_CAPTURED,)
        self._hooks: _LayersHooks | None = None
        self._mesh = MeshParts([])
        self._uniform = False
        self._all_have: tuple[float, ...] = ()
        if model is None:
            layer_groups(torch.nn.Module(), depth)  # checks depth now
        else:
            self.attach(model)
        self._rows = 0  # rows written so far: decides which optimizer step captures
        # what the pre-hook took for the coming row: (the [2P] pre-step norms, weights then gradients;
        # the gradient presence per layer; the scale the gradients still carried); None: nothing to capture
        self._pending: tuple[torch.Tensor, tuple[float, ...], torch.Tensor | None] | None = None
        self._pending_by: int | None = None
        self._weights_before: torch.Tensor | None = None  # [P], taken before the step
        self._grads_before: tuple[torch.Tensor, tuple[float, ...]] | None = None
        self._scale: torch.Tensor | None = None
        self._snapshot: list[torch.Tensor] | None = None  # the weights before the step (reused buffer)
        self._onehot: torch.Tensor | None = None  # [P, L]: sums per-parameter squares into layers
        self._row_inputs: StepInputs | None = None
        self._row_values: tuple[torch.Tensor | None, tuple[float, ...]] | None = None

    @property
    def attached(self) -> bool:
        """Whether the model is known (a ``Layers(None)`` waits for :meth:`attach`)."""
        return bool(self.names)

    def attach(self, model: torch.nn.Module) -> None:
        """Watch ``model``: for a ``Layers(None, ...)`` made before the model was (``bt.autolog``),
        called before the run's first row, when a run's columns are fixed.

        Raises:
            ConfigError: the model has no trainable parameter, or the metric watches one already.
        """
        if self.names:
            raise ConfigError("Layers.attach: this Layers watches a model already; make one Layers per model")
        if getattr(self, "_rows", 0):
            raise ConfigError(
                "Layers.attach: the run has written rows already, which fixed its columns; attach the model "
                "before the first tap.step()"
            )
        groups = layer_groups(model, self.depth)
        if not groups:
            raise ConfigError("Layers found no trainable parameter in the model; pass the model being trained")
        self.names = tuple(groups)
        self.parameters = [p for group in groups.values() for p in group]
        self.owners = tuple(i for i, group in enumerate(groups.values()) for _ in group)
        width = len(self.names)
        self.device_width = 3 * width
        self.host_width = 1 + width  # captured?, then per layer: whether it had a gradient
        self._outputs = tuple(
            Output(f"{kind}/{name}", NONNEGATIVE, Reduce.MAX) for kind in KINDS for name in self.names
        )
        self._not_captured = (_NOT_CAPTURED,) + (math.nan,) * width
        self._mesh = MeshParts(self.parameters)
        first = self.parameters[0]
        # one device and dtype (local shards have their DTensor's): the norms skip their grouping pass
        self._uniform = all(p.device == first.device and p.dtype == first.dtype for p in self.parameters)
        self._all_have = (1.0,) * width
        self._hooks = _LayersHooks(self)

    def __getstate__(self) -> dict[str, object]:
        # pipeline="process" finalizes in another process: the model, hooks and device values stay here
        state = self.__dict__.copy()
        state.update(
            parameters=[],
            scaler=None,
            _hooks=None,
            _mesh=None,
            _pending=None,
            _weights_before=None,
            _grads_before=None,
            _scale=None,
            _snapshot=None,
            _onehot=None,
            _row_inputs=None,
            _row_values=None,
        )
        return state

    def outputs(self) -> tuple[Output, ...]:
        return self._outputs

    @property
    def per_micro_batch(self) -> bool:
        return False  # once per optimizer step, at its row

    # ------------------------------------------------------------------ the optimizer step

    def capturing(self) -> bool:
        """Whether the coming optimizer step is one to capture (host counters only)."""
        return self._rows % self.every == 0

    def _take(self, optimizer: object, *, weights: bool = True, grads: bool = True) -> None:
        """In the step pre-hook: the gradient norms and the weights before the step, on the device
        (a step given a closure: the weights in the pre-hook, the gradients, which the closure
        computes, in the post-hook)."""
        if self._pending_by is not None and self._pending_by != id(optimizer):
            return  # a second optimizer of the model in the same step: the first one's take holds
        self._pending_by = id(optimizer)
        with torch.no_grad():  # the hooks run with grad mode on: no autograd record of the shards' views
            params = self._local_weights()
            if weights:
                if self._snapshot is None:
                    self._snapshot = [torch.empty_like(p) for p in params]
                torch._foreach_copy_(self._snapshot, params)
            if grads:
                self._scale = _scale_carried(self.scaler) if self.scaler is not None else None
            if weights and grads:  # the usual step: weight and gradient norms in one fused pass
                norms, have = self._grad_norms(params)
                self._pending = (norms, have, self._scale)
                self._scale = None
                return
            if weights:
                self._weights_before = torch.stack(_norms(params, self._uniform))
            if grads:
                self._grads_before = self._grad_norms([])
        if self._weights_before is not None and self._grads_before is not None:
            norms, have = self._grads_before
            before = torch.cat([self._weights_before.to(norms.device), norms])
            self._pending = (before, have, self._scale)
            self._weights_before = self._grads_before = self._scale = None

    def _local_weights(self) -> list[torch.Tensor]:
        """The parameters (the callers run under ``no_grad``: no detach needed, which would cost an
        op per parameter); of ``DTensor`` parameters (FSDP2) this rank's shard."""
        if not self._mesh.sharded:
            return self.parameters
        return self._mesh.local(self.parameters)  # type: ignore[return-value]

    def _grad_norms(self, weights: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[float, ...]]:
        """``[W + P]``: the norms of ``weights``, then the ``P`` gradient norms (0 for a parameter
        without a gradient) — one fused pass when every parameter has its gradient — and, per
        layer, 1.0 when any of its parameters had a gradient (host metadata)."""
        grads = self._mesh.local([p.grad for p in self.parameters])
        present = [g for g in grads if g is not None]
        if len(present) == len(grads):  # a gradient has its parameter's device and dtype (torch checks)
            return torch.stack(_norms(weights + present, self._uniform)), self._all_have
        have = [0.0] * len(self.names)
        for owner, grad in zip(self.owners, grads):
            if grad is not None:
                have[owner] = 1.0
        device = self.parameters[0].device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        found = iter(_norms(present))
        norms = _norms(weights) + [zero if g is None else next(found).to(device) for g in grads]
        return torch.stack(norms), tuple(have)

    # ------------------------------------------------------------------ the row

    def _row(self, inputs: StepInputs) -> tuple[torch.Tensor | None, tuple[float, ...]]:
        """This row's ``[3, L]`` values (None: not captured) and host columns. compute(), read_host()
        and the row writer all ask, in any order: the first ask of a row decides."""
        if inputs is self._row_inputs and self._row_values is not None:
            self._row_inputs = None
            return self._row_values
        pending, self._pending, self._pending_by = self._pending, None, None
        self._rows += 1
        capturing = self._rows % self.every == 0  # the next optimizer step's, listened to only if so
        if self._hooks is not None and capturing is not self._hooks.armed:
            self._hooks.arm(capturing)
        self._row_inputs = inputs
        if pending is None:
            values: tuple[torch.Tensor | None, tuple[float, ...]] = (None, self._not_captured)
        else:
            before, have, scale = pending
            with torch.no_grad():
                values = (self._finish(before, scale), (_CAPTURED, *have))
        self._row_values = values
        return values

    def _finish(self, before: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """``[3, L]``: per layer the gradient norm, the weight norm now, the update ratio (device
        ops: two fused norms over every parameter, one product summing them into layers)."""
        params = self._local_weights()
        snapshot = self._snapshot
        assert snapshot is not None
        torch._foreach_sub_(snapshot, params)  # the snapshot becomes w_before - w_after
        device = before.device
        after = torch.stack(_norms(params + snapshot, self._uniform))  # [2P]: weights now, then moved
        # [4, P]: weight before, gradient, weight after, moved
        squares = torch.cat([before, after.to(device, non_blocking=True)]).view(4, -1).square_()
        onehot = self._onehot
        if onehot is None or onehot.device != device:
            onehot = torch.zeros(len(self.owners), len(self.names), dtype=torch.float32, device=device)
            onehot[torch.arange(len(self.owners)), torch.tensor(self.owners)] = 1.0
            self._onehot = onehot
        # [4, L]: sharded parameters' squares are summed over the device mesh too (one collective)
        norms = self._mesh.sum_per_layer(squares, onehot).sqrt_()
        if scale is not None:  # the gradients were still scaled: divide on the device, never read the scale
            norms[1].div_(scale.to(device, non_blocking=True))
        norms[3].div_(norms[0])  # the update ratio
        return norms[1:]  # gradient, weight after, update ratio

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        values, _ = self._row(inputs)
        device = inputs.device or step_device(inputs)
        if values is None:
            nan = torch.full((), math.nan, dtype=torch.float32, device=device)
            return (nan,) * self.device_width
        if values.device != device:
            values = values.to(device, non_blocking=True)
        return tuple(values.reshape(-1).unbind())

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        return self._row(inputs)[1]

    def row_writer(self, example: StepInputs, columns: torch.Tensor) -> RowWriter:
        """Writes the row's columns only on captured rows (one copy); a row that does not capture
        is left as it is: its host column tells the pipeline to leave it out."""
        rows = [columns.select(0, slot) for slot in range(columns.shape[0])]

        def write(inputs: StepInputs, slot: int, fresh: bool) -> None:
            values, _ = self._row(inputs)
            if values is not None:
                rows[slot].copy_(values.reshape(-1), non_blocking=True)

        return write


def _norms(tensors: list[torch.Tensor], uniform: bool = False) -> list[torch.Tensor]:
    """Per-tensor L2 norms in at least float32, one fused kernel per (device, dtype), in order.
    ``uniform``: the caller knows all tensors share one device and dtype (no grouping pass)."""
    if not tensors:
        return []
    if uniform:
        norms = _foreach_norm_fp32(tensors)
        return norms if norms[0].dtype == torch.float32 else [n.float() for n in norms]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    if len(groups) == 1:
        return [n.float() if n.dtype != torch.float32 else n for n in _foreach_norm_fp32(tensors)]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    first = tensors[0].device
    for indices in groups.values():
        for i, norm in zip(indices, _foreach_norm_fp32([tensors[i] for i in indices])):
            norm = norm.float() if norm.dtype != torch.float32 else norm
            out[i] = norm if norm.device == first else norm.to(first, non_blocking=True)
    return [n for n in out if n is not None]


class _LayersHooks(ParameterStepListener["Layers"]):
    """What a :class:`Layers` (or :class:`~batchtap.metrics.histograms.Histograms`) does at the
    optimizer steps of its parameters, heard through batchtap's one pair of optimizer step hooks
    (:func:`~batchtap.metrics.optimizer_hooks.step_watch`). The metric holds it; it holds the metric
    weakly, so both go together and the watch forgets it.

    It listens only while the coming optimizer step captures (:meth:`arm`, from the metric's row):
    on the other steps the optimizer step does not call it at all, so a step that does not capture
    costs the row's one integer check."""

    __slots__ = ("armed",)

    def __init__(self, metric: Layers) -> None:
        super().__init__(metric, metric.parameters)
        self.armed = True  # row 0 captures

    def arm(self, capturing: bool) -> None:
        """Listen (``capturing``) or not to the coming optimizer steps; a change only when the
        answer changes (twice per ``every`` rows, never for ``every=1``)."""
        if capturing is self.armed:
            return
        self.armed = capturing
        if capturing:
            self.handle = step_watch().listen(self)  # type: ignore[arg-type]  # a StepListener
        else:
            self.handle.remove()
            self.closure = None

    def step_begins(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        self.closure = None
        metric = self.metric()
        if metric is None or not metric.capturing() or torch.compiler.is_compiling() or not self.owns(optimizer):
            return
        if closure:
            self.closure = optimizer  # the closure computes this step's gradients: take them after it
            metric._take(optimizer, grads=False)
            return
        metric._take(optimizer)

    def step_ends(self, optimizer: torch.optim.Optimizer, closure: bool) -> None:
        if self.closure is None:
            return
        taken, self.closure = self.closure, None
        metric = self.metric()
        if taken is optimizer and metric is not None:
            metric._take(optimizer, weights=False)
