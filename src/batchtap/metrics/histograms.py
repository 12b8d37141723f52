"""Histograms of each layer's weights and gradients every N optimizer steps, on the device with no
host read: fixed bins over the tensor's own range, its min and max kept so the edges are known."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from batchtap.errors import ConfigError
from batchtap.metrics._shared import step_device
from batchtap.metrics.base import Metric, RowWriter, StepInputs
from batchtap.metrics.domain import ANY_FINITE, NONNEGATIVE, Output, Reduce
from batchtap.metrics.gradients import _check_scaler, _scale_carried
from batchtap.metrics.layer_decoders import CAPTURED, NOT_CAPTURED, HistogramsDecoding
from batchtap.metrics.layer_sharding import MeshParts
from batchtap.metrics.layers import _LayersHooks, layer_groups

__all__ = ["Histograms", "histogram", "histogram_edges", "HISTOGRAM_PREFIX"]

#: every histogram value's name starts with this: ``hist/<kind>/<layer>/<min|max|i>``
HISTOGRAM_PREFIX = "hist/"
_KINDS = ("weight", "grad")
_NOT_CAPTURED, _CAPTURED = NOT_CAPTURED, CAPTURED


def histogram(tensors: Sequence[torch.Tensor], bins: int) -> torch.Tensor:
    """``[2 + bins]`` float32 on the tensors' device: min, max, then the counts of ``bins`` equal
    bins spanning ``[min, max]`` of all elements together (the last bin includes ``max``, as
    ``numpy.histogram``'s does). Device ops only: the range is normalised on the device and
    ``torch.histc`` runs over the fixed range [0, 1], so no bound is read on the host. A constant
    tensor puts every element in the first bin.

    Example:
        >>> histogram([torch.tensor([0.0, 1.0, 1.0, 4.0])], bins=4)
        tensor([0., 4., 1., 2., 0., 1.])
    """
    flat = _flat(tensors)
    bounds = _bounds(flat)
    return torch.cat([bounds, _counts(flat, bounds, bins)])


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _bounds(flat: torch.Tensor) -> torch.Tensor:
    """``[2]``: min and max; of no element (a rank's empty shard) +inf and -inf, which a max over
    the ranks ignores (the element count is host metadata: no read)."""
    if not flat.numel():
        inf = torch.full((), math.inf, dtype=torch.float32, device=flat.device)
        return torch.stack([inf, -inf])
    return torch.stack([flat.amin(), flat.amax()])


def _counts(flat: torch.Tensor, bounds: torch.Tensor, bins: int) -> torch.Tensor:
    """``[bins]`` counts of ``flat`` over ``[bounds[0], bounds[1]]`` (device tensors)."""
    span = (bounds[1] - bounds[0]).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.histc(flat.sub(bounds[0]).div_(span), bins=bins, min=0.0, max=1.0)


def histogram_edges(low: float, high: float, bins: int) -> np.ndarray:
    """The ``bins + 1`` edges of a histogram of :func:`histogram` (host side).

    Example:
        >>> histogram_edges(0.0, 4.0, 4).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0]
    """
    return np.linspace(low, high, bins + 1)


class Histograms(HistogramsDecoding, Metric):
    """Per-layer histograms of the weights (after the step) and of the gradients (as the optimizer
    step used them; unscaled under AMP with ``scaler=``) every ``every``-th optimizer step.

    Each histogram is ``bins`` equal bins over the layer's own range at that step, with the range
    kept: values ``hist/<weight|grad>/<layer>/min``, ``.../max`` and ``.../0`` ... ``.../<bins-1>``
    (the counts). They travel in the ring like any value; the SQL stores keep them compactly (one
    row per layer, kind and captured step), exports and the browser view draw them as heatmaps.
    Steps that do not capture run nothing on the device; which steps capture follows
    :class:`~batchtap.metrics.Layers` (step 0, then every ``every``-th).

    Under FSDP2 (``DTensor`` parameters) each rank counts its shard over the global range (minima
    and maxima combined over the mesh first) and the counts are summed over the mesh, so every
    rank holds the histogram of the whole parameters; this needs every watched parameter sharded
    the same way (``fully_shard`` of the whole model), else a ConfigError says so.

    Args:
        model: the module whose parameters to watch.
        every: capture every ``every``-th optimizer step.
        depth: how many components of the module path name a layer.
        bins: bins per histogram (2 to 512).
        scaler: the AMP ``GradScaler``; gradients still scaled are measured unscaled.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> [o.name for o in Histograms(model, bins=2).outputs()][:5]
        ['hist/weight/0/min', 'hist/weight/0/max', 'hist/weight/0/0', 'hist/weight/0/1', 'hist/weight/2/min']
    """

    gradient_based: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        every: int = 10,
        depth: int = 1,
        bins: int = 32,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"Histograms needs the model (a torch.nn.Module), got {type(model).__name__}; "
                "fix: bt.metrics.Histograms(model)"
            )
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"Histograms every must be an int >= 1, got {every!r}; fix: e.g. every=10")
        if not isinstance(bins, int) or isinstance(bins, bool) or not 2 <= bins <= 512:
            raise ConfigError(f"Histograms bins must be an int in [2, 512], got {bins!r}; fix: e.g. bins=32")
        groups = layer_groups(model, depth)
        if not groups:
            raise ConfigError("Histograms found no trainable parameter in the model; pass the model being trained")
        if scaler is not None:
            _check_scaler(scaler, "Histograms")
        self.every, self.depth, self.bins, self.scaler = every, depth, bins, scaler
        self.names: tuple[str, ...] = tuple(groups)
        self.groups: list[list[torch.Tensor]] = [list(g) for g in groups.values()]
        self.parameters: list[torch.Tensor] = [p for g in self.groups for p in g]
        width = len(self.names)
        self.device_width = len(_KINDS) * width * (bins + 2)
        self.host_width = 1 + width  # captured?, then per layer: whether it had a gradient
        self._outputs = tuple(
            Output(
                f"{HISTOGRAM_PREFIX}{kind}/{name}/{part}",
                ANY_FINITE if part in ("min", "max") else NONNEGATIVE,
                Reduce.MAX,
            )
            for kind in _KINDS
            for name in self.names
            for part in ("min", "max", *map(str, range(bins)))
        )
        self._not_captured: tuple[float, ...] = (_NOT_CAPTURED,) + (math.nan,) * width
        self._mesh = MeshParts(self.parameters)
        self._mesh.uniform("Histograms")
        self._rows = 0
        self._grads: tuple[torch.Tensor, tuple[float, ...]] | None = None  # [L, bins + 2] at the step
        self._pending_by: int | None = None
        self._row_inputs: StepInputs | None = None
        self._row_values: tuple[torch.Tensor | None, tuple[float, ...]] | None = None
        self._hooks: _LayersHooks | None = _LayersHooks(self)  # type: ignore[arg-type]  # the same hook protocol

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state.update(
            parameters=[],
            groups=[],
            scaler=None,
            _hooks=None,
            _mesh=None,
            _grads=None,
            _row_inputs=None,
            _row_values=None,
        )
        return state

    def outputs(self) -> tuple[Output, ...]:
        return self._outputs

    @property
    def per_micro_batch(self) -> bool:
        return False

    def capturing(self) -> bool:
        """Whether the coming optimizer step is one to capture (host counters only)."""
        return self._rows % self.every == 0

    def _take(self, optimizer: object, *, weights: bool = True, grads: bool = True) -> None:
        """In the step's hook: the gradients' histograms (the weights' are taken at the row)."""
        if not grads or (self._pending_by is not None and self._pending_by != id(optimizer)):
            return
        self._pending_by = id(optimizer)
        local = self._mesh.local
        present = [[g for g in local([p.grad for p in group]) if g is not None] for group in self.groups]
        have = tuple(1.0 if g else 0.0 for g in present)
        scale = _scale_carried(self.scaler) if self.scaler is not None else None
        with torch.no_grad():
            rows = self._histograms(present)
            if scale is not None:  # still scaled: the counts are not, the range is
                rows[:, :2].div_(scale.to(rows.device, non_blocking=True))
            for i, had in enumerate(have):
                if not had:
                    rows[i].zero_()
            self._grads = (rows, have)

    def _histograms(self, groups: list[list[torch.Tensor]]) -> torch.Tensor:
        """``[L, 2 + bins]`` per layer: min, max, counts. Sharded (FSDP2) parameters: each rank's
        shard is counted over the global range (minima and maxima combined over the mesh first),
        then the counts summed over the mesh: two collectives, on the device."""
        device = self.parameters[0].device
        flats = [_flat(g) if g else torch.empty(0, device=device) for g in groups]
        bounds = torch.stack([_bounds(f).to(device) for f in flats])  # [L, 2]
        if self._mesh.sharded:  # the global min is minus the max of the negated minima
            bounds = self._mesh.combine(torch.stack([-bounds[:, 0], bounds[:, 1]], dim=1), "max")
            bounds = torch.stack([-bounds[:, 0], bounds[:, 1]], dim=1)
        counts = torch.stack([_counts(f, b.to(f.device), self.bins).to(device) for f, b in zip(flats, bounds)])
        return torch.cat([bounds, self._mesh.combine(counts, "sum")], dim=1)

    def _row(self, inputs: StepInputs) -> tuple[torch.Tensor | None, tuple[float, ...]]:
        if inputs is self._row_inputs and self._row_values is not None:
            self._row_inputs = None
            return self._row_values
        grads, self._grads, self._pending_by = self._grads, None, None
        self._rows += 1
        capturing = self._rows % self.every == 0  # the next optimizer step's, listened to only if so
        if self._hooks is not None and capturing is not self._hooks.armed:
            self._hooks.arm(capturing)
        self._row_inputs = inputs
        if grads is None:
            values: tuple[torch.Tensor | None, tuple[float, ...]] = (None, self._not_captured)
        else:
            with torch.no_grad():
                weights = self._histograms([self._mesh.local(g) for g in self.groups])  # type: ignore[misc]
                values = (torch.cat([weights, grads[0]]).reshape(-1), (_CAPTURED, *grads[1]))
        self._row_values = values
        return values

    def compute(self, inputs: StepInputs) -> Sequence[torch.Tensor]:
        values, _ = self._row(inputs)
        device = inputs.device or step_device(inputs)
        if values is None:
            return (torch.full((), math.nan, dtype=torch.float32, device=device),) * self.device_width
        return tuple(values.to(device, non_blocking=True).unbind())

    def read_host(self, inputs: StepInputs) -> Sequence[float]:
        return self._row(inputs)[1]

    def row_writer(self, example: StepInputs, columns: torch.Tensor) -> RowWriter:
        """Writes only captured rows (one copy); other rows keep what they hold, and their host
        column tells the pipeline to leave them out."""
        rows = [columns.select(0, slot) for slot in range(columns.shape[0])]

        def write(inputs: StepInputs, slot: int, fresh: bool) -> None:
            values, _ = self._row(inputs)
            if values is not None:
                rows[slot].copy_(values, non_blocking=True)

        return write
