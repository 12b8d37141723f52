"""Pure metric math on tensors: no host reads, safe to call inside a training step.

Every function returns device tensors; none calls ``.item()``, ``.cpu()``, ``.tolist()`` or
``bool()`` on a tensor, so none makes the host wait for the device. Counts come back either as
float32 (exact below 2**24, the cheap form for a step's counts) or as int64 (exact at any size; see
:func:`split_count`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from batchtap.metrics.decoders import EXACT_FLOAT32  # float32 holds every integer up to it exactly

__all__ = [
    "topk_correct",
    "top1_correct",
    "top1_indices",
    "kept_mask",
    "target_range",
    "split_count",
    "EXACT_FLOAT32",
    "global_grad_norm",
    "grads_norm",
]


def topk_correct(
    outputs: torch.Tensor,
    targets: torch.Tensor,
    ks: Sequence[int],
    *,
    class_dim: int = 1,
    dtype: torch.dtype = torch.float32,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Number of positions whose target is among the top-``k`` scores, for each ``k`` in ``ks``.

    A target no class index can equal (e.g. an ignored ``-100``) is never counted; positions where
    ``keep`` is False are not counted either (an ignored value that *is* a class index, e.g. 0).

    Args:
        outputs: scores, any float dtype: ``[N, C]``, ``[N, C, d1, ...]`` (``class_dim=1``, the
            ``F.cross_entropy`` layout) or ``[B, T, V]`` (``class_dim=-1``, sequence logits).
        targets: class indices, integer dtype, the shape of ``outputs`` without ``class_dim``.
        ks: increasing top-k values, each ``<= C``.
        class_dim: the dimension of ``outputs`` that holds the classes.
        dtype: ``torch.float32`` (exact below 2**24 positions) or ``torch.int64`` (exact always).
        keep: boolean mask of the targets' shape: the positions that count (None: all).

    Returns:
        tensor ``[len(ks)]`` of counts on ``outputs.device``.

    Example:
        >>> scores = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.15, 0.05]])
        >>> topk_correct(scores, torch.tensor([1, 1]), ks=(1, 2))
        tensor([1., 2.])
        >>> logits = torch.tensor([[[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]])  # [B=1, T=3, V=2]
        >>> topk_correct(logits, torch.tensor([[1, 1, -100]]), ks=(1,), class_dim=-1)
        tensor([1.])
    """
    class_dim = class_dim % outputs.dim()
    top = outputs.topk(max(ks), dim=class_dim).indices  # [..., maxk at class_dim, ...], best first
    hits = top.eq(targets.unsqueeze(class_dim))  # at most one True along class_dim
    if keep is not None:
        hits = hits.logical_and(keep.unsqueeze(class_dim))
    other = [d for d in range(hits.dim()) if d != class_dim]
    hits_by_rank = hits.sum(dim=other, dtype=dtype)  # [maxk]
    # cumulative over the k axis: hit within the first k <=> any hit in ranks [0, k)
    cumulative = hits_by_rank.cumsum(0)
    # select() views instead of an index tensor: building one would be a host->device copy per step
    return torch.stack([cumulative.select(0, k - 1) for k in ks])


def top1_correct(
    outputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    class_dim: int = 1,
    dtype: torch.dtype = torch.float32,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Number of positions whose highest score is the target: three device ops (four with
    ``keep``), 0-dim.

    A target no class index can equal (e.g. an ignored ``-100``) is never counted, so ``keep``
    (the positions that count) is needed only when the ignored value is a class index.

    Example:
        >>> top1_correct(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1]))
        tensor(2.)
    """
    hits = top1_indices(outputs, class_dim).eq(targets)
    if keep is not None:
        hits = hits.logical_and(keep)
    return hits.sum(dtype=dtype)


#: From this many scores up, on the CPU, ``max(dim).indices`` finds the indices ``argmax(dim)`` finds
#: in about half the time (torch's CPU argmax is a generic index reduction, slow over short class rows:
#: ~78 vs ~42 us for [8, 64, 65] logits); below it argmax's lighter call is cheaper.
CPU_MAX_FROM = 4096


def top1_indices(outputs: torch.Tensor, class_dim: int) -> torch.Tensor:
    """``outputs.argmax(class_dim)``: the index of the first highest score (a NaN counts as the
    highest), through ``max(class_dim).indices`` on the CPU for large inputs, which gives the same
    indices (ties and NaNs included, tested) faster there.

    Example:
        >>> top1_indices(torch.tensor([[0.1, 0.9, 0.9], [0.8, 0.2, 0.0]]), 1)
        tensor([1, 0])
    """
    if outputs.is_cpu and outputs.numel() >= CPU_MAX_FROM:
        return outputs.max(class_dim).indices
    return outputs.argmax(class_dim)


def kept_mask(targets: torch.Tensor, ignore_index: int | None) -> torch.Tensor | None:
    """Where ``targets`` differ from ``ignore_index`` (one device op), or None when every target
    counts: no ``ignore_index``, or one the targets' dtype cannot hold (decided from the dtype).

    Example:
        >>> kept_mask(torch.tensor([3, -100, 1]), -100)
        tensor([ True, False,  True])
        >>> kept_mask(torch.tensor([3, 1], dtype=torch.uint8), -100) is None
        True
    """
    if ignore_index is None:
        return None
    info = torch.iinfo(targets.dtype)
    if not info.min <= ignore_index <= info.max:
        return None
    return targets.ne(ignore_index)


def target_range(targets: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest target index (among the kept ones) as 0-dim tensors of the targets'
    dtype: one device op, two with a ``keep`` mask.

    Left-out targets count as 0, which is always a valid index, so the range still shows every
    kept index below 0 or at/above the number of classes (and is ``(0, 0)`` when nothing is kept).
    The host compares it with the number of classes once the row arrived, which is cheaper per step
    than counting the offending targets on the device.

    Example:
        >>> target_range(torch.tensor([3, 0, 7]))
        (tensor(0), tensor(7))
        >>> target_range(torch.tensor([3, -100, 7]), keep=torch.tensor([True, False, True]))
        (tensor(0), tensor(7))
    """
    if keep is not None:
        targets = targets * keep  # left out -> 0; one op, no scalar tensor as torch.where makes
    low, high = torch.aminmax(targets)
    return low, high


def split_count(count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int64 count as two parts that float32 holds exactly: ``(count mod 2**24, count // 2**24)``.

    ``high * 2**24 + low`` gives the count back on the host, exact for counts below 2**48.

    Example:
        >>> low, high = split_count(torch.tensor(2**24 * 3 + 5))
        >>> low, high
        (tensor(5), tensor(3))
        >>> int(high) * 2**24 + int(low)
        50331653
    """
    return count.bitwise_and(EXACT_FLOAT32 - 1), count.bitwise_right_shift(24)


def global_grad_norm(parameters: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients of ``parameters`` together (as ``clip_grad_norm_`` computes it).

    Parameters without a gradient are skipped; with no gradient at all the norm is 0. See
    :func:`grads_norm`.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.full((4,), 2.0)
        >>> global_grad_norm([w], torch.device("cpu"))
        tensor(4.)
    """
    return grads_norm([p.grad for p in parameters if p.grad is not None], device)


def grads_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of the given tensors together, 0-dim on ``device`` (float32; float64 when a gradient
    is float64), no sync.

    Each tensor's norm is accumulated in float32 whatever its dtype (bf16/fp16 gradients
    included), with one fused kernel per device and dtype, so the total takes ``groups + 2`` device
    ops however many tensors there are. No tensor at all gives 0.

    Example:
        >>> grads_norm([torch.full((4,), 2.0, dtype=torch.bfloat16), torch.tensor([3.0])], torch.device("cpu"))
        tensor(5.)
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    if not groups:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms: list[torch.Tensor] = []
    for (where, _), group in groups.items():
        part = _foreach_norm_fp32(group)
        if where != device:  # model parallel: one norm per device, moved to the capture device
            part = [torch.linalg.vector_norm(torch.stack(part)).to(device, non_blocking=True)]
        norms.extend(part)
    return torch.linalg.vector_norm(torch.stack(norms))


_FOREACH_DTYPE = True  # torch._foreach_norm takes dtype= (torch >= 2.1 in practice); set False if not


def _foreach_norm_fp32(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor norms, accumulated in at least float32 (one group: one device and dtype)."""
    global _FOREACH_DTYPE
    if grads[0].dtype in (torch.float32, torch.float64):  # already at least float32 (dtype= may not narrow)
        return list(torch._foreach_norm(grads, 2))
    if _FOREACH_DTYPE:
        try:
            return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
        except TypeError:
            _FOREACH_DTYPE = False
    return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
