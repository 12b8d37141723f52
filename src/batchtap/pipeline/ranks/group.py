"""Process-group facts with one code path for one process and many: outside an initialized
``torch.distributed`` group every function answers as a single process would.

Public to batchtap's packages (the Tap asks it for the rank and the run id every rank shares);
not part of the user-facing API."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["rank", "world_size", "is_distributed", "shared_run_id", "describe_failure"]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def shared_run_id(proposed: str, group: Any) -> str:
    """Rank 0's run id, on every rank of ``group`` (a collective: every rank calls it at the
    start of each run). ``proposed`` is this rank's own id, a 32-digit hex uuid.
    """
    if not is_distributed():
        return proposed
    buf = torch.tensor(list(bytes.fromhex(proposed)), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=group)
    # sync: run start — a CPU tensor of batchtap's own gloo group, read once per run
    return bytes(buf.tolist()).hex()


def describe_failure(exc: BaseException, timeout: float) -> str:
    """What a failed collective says happened: a peer that closed its connection (it died or
    left) is told apart from one that did not answer within ``timeout``."""
    text = str(exc)
    lowered = text.lower()
    if any(
        s in lowered
        for s in ("connection closed by peer", "connection reset by peer", "broken pipe", "end of file", "eof")
    ):
        return f"a peer rank closed its connection (it died or left the group): {type(exc).__name__}: {text}"
    if "timed out" in lowered or "timeout" in lowered:
        return f"no answer within {timeout:g} s (a rank stalled or died): {type(exc).__name__}: {text}"
    return f"{type(exc).__name__}: {text}"
