"""Per-layer values of sharded parameters (FSDP2's ``fully_shard``, tensor parallel): each rank
holds a shard of every ``DTensor`` parameter, so a layer's norm or histogram is its ranks' partial
values combined over the device mesh, on the device, with no host read.

:class:`MeshParts` is built once from the watched parameters (host metadata only: which are
``DTensor``, on which mesh, sharded over which mesh dimensions). :class:`~batchtap.metrics.Layers`
and :class:`~batchtap.metrics.Histograms` then work on the local shards (``to_local()``, no
communication) and combine per layer: squared norms summed, minima and maxima taken, bin counts
summed — one collective per combination on captured steps, none on the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchtap.errors import ConfigError
from batchtap.metrics.optimizer_hooks import dtensor_type

__all__ = ["MeshParts"]


class MeshParts:
    """How the partial values of ``params`` combine into global ones.

    Parameters fall in classes: plain tensors (and ``DTensor`` replicated on every mesh dimension),
    whose local value is already the global one, and per (mesh, sharded mesh dimensions) the
    ``DTensor`` shards, whose values are combined over those mesh dimensions.

    Example:
        >>> parts = MeshParts([torch.nn.Parameter(torch.ones(2))])
        >>> parts.sharded, parts.sum_per_layer(torch.ones(1, 1), torch.ones(1, 1)).tolist()
        (False, [[1.0]])
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        dtensor = dtensor_type()
        self.plain: list[int] = []
        # (mesh, which mesh dimensions shard) -> the mesh and the parameter indices of that class; a
        # DeviceMesh compares by its ranks (fully_shard of each layer makes equal meshes, not one)
        self.classes: dict[tuple[object, tuple[bool, ...]], tuple[object, list[int]]] = {}
        for i, p in enumerate(params):
            if dtensor is None or not isinstance(p, dtensor):
                self.plain.append(i)
                continue
            shard_dims = tuple(bool(placement.is_shard()) for placement in p.placements)  # type: ignore[attr-defined]
            if any(getattr(placement, "is_partial", lambda: False)() for placement in p.placements):  # type: ignore[attr-defined]
                raise ConfigError(
                    "per-layer metrics got a parameter that is a Partial DTensor (a value still to be "
                    "reduced), which no optimizer steps; fix: watch the model's sharded or replicated parameters"
                )
            if not any(shard_dims):
                self.plain.append(i)  # replicated over the whole mesh: the local value is global
                continue
            mesh = p.device_mesh  # type: ignore[attr-defined]
            self.classes.setdefault((mesh, shard_dims), (mesh, []))[1].append(i)
        #: whether any parameter is sharded (then every value is combined over the mesh)
        self.sharded = bool(self.classes)
        self._dtensor = dtensor
        self._index: dict[tuple[int, torch.device], torch.Tensor] = {}  # class -> its indices, made once

    def local(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each tensor's local shard (a plain tensor as it is; no communication)."""
        if not self.sharded:
            return list(tensors)
        dtensor = self._dtensor
        assert dtensor is not None
        return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]  # type: ignore[union-attr]

    def uniform(self, what: str) -> None:
        """Raises a ConfigError unless every parameter is in one class (what a histogram needs: its
        bin counts are summed over the mesh, which would count replicated parameters once per rank)."""
        if self.sharded and (self.plain or len(self.classes) > 1):
            raise ConfigError(
                f"{what} on sharded (DTensor) parameters needs every watched parameter sharded the same way "
                f"on one device mesh (fully_shard of the whole model); this model mixes {len(self.classes)} "
                f"sharding(s) with {len(self.plain)} unsharded parameter(s); fix: fully_shard the whole model, "
                "or watch a submodule whose parameters are all sharded alike"
            )

    def combine(self, value: torch.Tensor, op: str) -> torch.Tensor:
        """``value`` (each rank's partial) combined with ``op`` ("sum", "max", "min") over the mesh
        dimensions the parameters are sharded on; for :meth:`uniform` parameters only."""
        if not self.sharded:
            return value
        (mesh, _), = self.classes.values()  # fmt: skip
        shard_dims = next(iter(self.classes))[1]
        return _over_mesh(value, mesh, shard_dims, op)

    def sum_per_layer(self, values: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
        """``values`` ``[K, P]`` per parameter (squared norms of the local shards) summed into
        ``[K, L]`` per layer through the ``[P, L]`` 0/1 matrix ``onehot``, shards summed over the mesh."""
        if not self.sharded:
            return values @ onehot
        total: torch.Tensor | None = None
        if self.plain:
            index = self._indices(-1, self.plain, values.device)
            total = values.index_select(1, index) @ onehot.index_select(0, index)
        for n, ((_, shard_dims), (mesh, members)) in enumerate(self.classes.items()):
            index = self._indices(n, members, values.device)
            part = _over_mesh(values.index_select(1, index) @ onehot.index_select(0, index), mesh, shard_dims, "sum")
            total = part if total is None else total + part
        assert total is not None
        return total

    def _indices(self, key: int, members: list[int], device: torch.device) -> torch.Tensor:
        index = self._index.get((key, device))
        if index is None:  # once per class and device: a host-to-device copy, not on every capture
            index = self._index[(key, device)] = torch.tensor(members, device=device)
        return index


def _over_mesh(value: torch.Tensor, mesh: object, shard_dims: tuple[bool, ...], op: str) -> torch.Tensor:
    """``value`` combined with ``op`` over the mesh dimensions marked in ``shard_dims``: torch's
    own redistribution of a Partial ``DTensor`` (the collective of ``.full_tensor()``), on the
    device."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Partial, Replicate

    placements = [Partial(op) if sharded else Replicate() for sharded in shard_dims]
    partial = DTensor.from_local(value, mesh, placements, run_check=False)  # type: ignore[arg-type]
    full: torch.Tensor = partial.full_tensor()
    return full
