"""Pure metric math on tensors: float32, no host reads, safe to call inside a training step.

Every function returns device tensors; none calls ``.item()``, ``.cpu()``, ``.tolist()`` or
``bool()`` on a tensor, so none makes the host wait for the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["topk_correct", "top1_correct", "target_range", "global_grad_norm"]


def topk_correct(outputs: torch.Tensor, targets: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """Number of samples whose target is among the top-``k`` scores, for each ``k`` in ``ks``.

    Args:
        outputs: scores ``[N, C]`` (or ``[N, C, d1, ...]`` for dense prediction), any float dtype.
        targets: class indices ``[N]`` (or ``[N, d1, ...]``), integer dtype.
        ks: increasing top-k values, each ``<= C``.

    Returns:
        float32 tensor ``[len(ks)]`` of counts on ``outputs.device``. Counts are integers, exact in
        float32 up to 2**24 samples per step.

    Example:
        >>> scores = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.15, 0.05]])
        >>> topk_correct(scores, torch.tensor([1, 1]), ks=(1, 2))
        tensor([1., 2.])
    """
    if outputs.dim() > 2:  # dense prediction: move classes last, then one row per position
        outputs = outputs.movedim(1, -1).reshape(-1, outputs.shape[1])
        targets = targets.reshape(-1)
    maxk = max(ks)
    top = outputs.topk(maxk, dim=1).indices  # [M, maxk], best first
    hits = top.eq(targets.unsqueeze(1))  # at most one True per row
    # cumulative over the k axis: hit within the first k <=> any hit in columns [0, k)
    hits_by_rank = hits.sum(dim=0, dtype=torch.float32)  # [maxk]
    cumulative = hits_by_rank.cumsum(0)
    # select() views instead of an index tensor: building one would be a host->device copy per step
    return torch.stack([cumulative.select(0, k - 1) for k in ks])


def top1_correct(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Number of samples whose highest score is the target: three device ops, float32 0-dim.

    Example:
        >>> top1_correct(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1]))
        tensor(2.)
    """
    return outputs.argmax(1).eq(targets).sum(dtype=torch.float32)


def target_range(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest target index as float32 0-dim tensors, in one device op.

    The host compares them with the number of classes once the row arrived, which is cheaper per
    step than counting the offending targets on the device.

    Example:
        >>> target_range(torch.tensor([3, 0, 7]))
        (tensor(0.), tensor(7.))
    """
    low, high = torch.aminmax(targets.to(torch.float32))  # exact for indices below 2**24
    return low, high


def global_grad_norm(parameters: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """L2 norm of all gradients together (as ``clip_grad_norm_`` computes it), float32, no sync.

    Parameters without a gradient are skipped; with no gradient at all the norm is 0.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(4)); w.grad = torch.full((4,), 2.0)
        >>> global_grad_norm([w], torch.device("cpu"))
        tensor(4.)
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads)  # one fused kernel per dtype/device group
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.to(device=device, dtype=torch.float32, non_blocking=True)
