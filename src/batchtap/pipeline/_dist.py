"""Process-group facts with one code path for one process and many: outside an initialized
``torch.distributed`` group every function answers as a single process would."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["rank", "world_size", "is_distributed"]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1
