"""Survive an out-of-memory batch: retry it in smaller chunks with gradient accumulation.

:func:`split_on_oom` runs forward and backward for one batch. If that raises a CUDA out-of-memory
error (or a ``RuntimeError`` saying "out of memory", as other backends do), it drops the partial
gradients, halves the chunk size and runs the batch again as several chunks, each loss scaled by its
share of the batch, so the accumulated gradient equals the full batch's (for a mean-reduced loss).
It then lowers the adaptive sampler's batch size to the chunk that fit, so the next batches do not
fail again. The optimizer step stays with the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from batchtap._validate import require_int
from batchtap.errors import ConfigError, InputError
from batchtap.rules.base import BatchSizeTarget

__all__ = ["SplitResult", "is_oom_error", "split_on_oom"]

#: A batch: a tensor, or a (nested) tuple/list/dict of tensors sharing their first dimension.
Batch = Any
#: ``(inputs, targets) -> loss`` for a chunk, mean-reduced over the chunk.
LossFn = Callable[[Batch, Batch], torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class SplitResult:
    """The outcome of :func:`split_on_oom`.

    Attributes:
        loss: the batch loss (chunk losses weighted by their share), detached, on the device.
        chunk_size: the chunk size that fit (the batch size when nothing failed).
        chunks: how many chunks the batch ran as.
        retries: how many out-of-memory errors were caught.
    """

    loss: torch.Tensor
    chunk_size: int
    chunks: int
    retries: int


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error (``torch.OutOfMemoryError`` or an "out of memory" RuntimeError).

    Example:
        >>> is_oom_error(torch.OutOfMemoryError("CUDA out of memory")), is_oom_error(ValueError("x"))
        (True, False)
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def split_on_oom(
    loss_fn: LossFn,
    inputs: Batch,
    targets: Batch,
    *,
    zero_grad: Callable[[], object],
    min_chunk: int = 1,
    sampler: BatchSizeTarget | None = None,
) -> SplitResult:
    """Forward + backward one batch, retrying it in smaller chunks after an out-of-memory error.

    Args:
        loss_fn: ``(inputs, targets) -> loss`` for a chunk; the loss must be a mean over the chunk.
        inputs: the batch inputs (tensor or nested tuple/list/dict of tensors, batch first).
        targets: the batch targets (same structure rules).
        zero_grad: drops gradients before a retry (e.g. ``optimizer.zero_grad``): a backward that
            failed halfway has already added to some ``.grad`` s. Gradients must therefore be zero
            (or None) when ``split_on_oom`` is called.
        min_chunk: the smallest chunk to try; an error at this size is re-raised.
        sampler: if given, its batch size is lowered to the chunk size that fit.

    Returns:
        The loss, the chunk size that worked, how many chunks and retries it took.

    Raises:
        torch.OutOfMemoryError: even ``min_chunk`` samples do not fit (the original error).
        InputError: inputs and targets disagree on the batch size.

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> def loss_fn(x, y):
        ...     if x.shape[0] > 4:                                   # pretend more than 4 do not fit
        ...         raise torch.OutOfMemoryError("CUDA out of memory")
        ...     return torch.nn.functional.mse_loss(model(x), y)
        >>> g = torch.Generator().manual_seed(0)
        >>> x, y = torch.randn(10, 3, generator=g), torch.randn(10, 1, generator=g)
        >>> r = split_on_oom(loss_fn, x, y, zero_grad=model.zero_grad)
        >>> r.chunk_size, r.chunks, r.retries
        (3, 4, 2)
    """
    require_int("split_on_oom", "min_chunk", min_chunk, minimum=1)
    if not callable(zero_grad):
        raise ConfigError("split_on_oom: zero_grad must be callable, e.g. optimizer.zero_grad.")
    n = _batch_len(inputs)
    if _batch_len(targets) != n:
        raise InputError(f"inputs and targets disagree on batch size: {n} vs {_batch_len(targets)}")
    chunk, retries = n, 0
    while True:
        try:
            loss, chunks = _run_chunks(loss_fn, inputs, targets, n, chunk)
            break
        except RuntimeError as exc:
            if not is_oom_error(exc) or chunk <= min_chunk:
                raise
            failed = chunk
        # Retry outside the except block: the exception's traceback pins the failed attempt's
        # activations, and leaving the block releases them before the next try allocates.
        retries += 1
        chunk = max(min_chunk, (failed + 1) // 2)
        zero_grad()
    if sampler is not None and chunk < n:
        sampler.set_batch_size(chunk)
    return SplitResult(loss=loss, chunk_size=chunk, chunks=chunks, retries=retries)


def _run_chunks(loss_fn: LossFn, inputs: Batch, targets: Batch, n: int, chunk: int) -> tuple[torch.Tensor, int]:
    total: torch.Tensor | None = None
    count = 0
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        loss = loss_fn(_slice(inputs, start, stop), _slice(targets, start, stop))
        share = (stop - start) / n  # mean loss per chunk -> weight by the chunk's share of the batch
        (loss * share).backward()
        part = loss.detach() * share
        total = part if total is None else total + part
        count += 1
    assert total is not None
    return total, count


def _batch_len(batch: Batch) -> int:
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise InputError("a batch tensor needs a batch dimension, got a 0-d tensor")
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) and batch:
        return _batch_len(batch[0])
    raise InputError(f"expected a tensor or a tuple/list/dict of tensors, got {type(batch).__name__}")


def _slice(batch: Batch, start: int, stop: int) -> Batch:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, start, stop) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple):
        return (
            type(batch)(*(_slice(v, start, stop) for v in batch))
            if hasattr(batch, "_fields")
            else tuple(_slice(v, start, stop) for v in batch)
        )
    if isinstance(batch, list):
        return [_slice(v, start, stop) for v in batch]
    raise InputError(f"cannot split a {type(batch).__name__} along the batch dimension")
