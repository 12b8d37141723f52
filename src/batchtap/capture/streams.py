"""The CUDA stream a run's capture is tied to.

A run's ring rows, their end-of-step events, the NaN guard's copies and the flush copies are all
queued on the stream that was current when the run's first step was captured; stream order is what
makes a flushed block's copy see the rows written before it. A step queued on another stream could
be copied before it was written. So each step on CUDA checks that the current stream is still that
one (a host-side lookup, no device call) and refuses a step on another stream with a clear error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchtap.errors import InputError

__all__ = ["StreamCheck", "stream_check_for"]

#: the current stream of a CUDA device as a comparable key (torch's own lookup, else the public one)
_lookup: Callable[[int], object] | None = getattr(torch._C, "_cuda_getCurrentStream", None)


def current_stream_key(device: torch.device) -> object:
    """An identity of ``device``'s current stream (cheap: no Stream object when torch offers that)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _lookup is not None:
        return _lookup(index)
    stream = torch.cuda.current_stream(device)
    return (stream.cuda_stream, index)


class StreamCheck:
    """Remembers the current stream at creation; :meth:`check` raises when a later step runs on another.

    Args:
        device: the capture's CUDA device.
        key: how to read the current stream's identity (tests pass their own).
    """

    def __init__(self, device: torch.device, key: Callable[[torch.device], object] = current_stream_key) -> None:
        self.device = device
        self._key = key
        self.stream = key(device)

    def check(self) -> None:
        """Raise :class:`InputError` when the current stream is not the run's."""
        if self._key(self.device) != self.stream:
            raise InputError(
                f"tap.step() was called on another CUDA stream than the run's first step "
                f"({self._key(self.device)!r}, not {self.stream!r}); batchtap queues its ring writes and "
                "copies on the run's stream, so call tap.step() there (outside `with torch.cuda.stream(s):`), "
                "after `torch.cuda.current_stream().wait_stream(s)` when the step's tensors came from s"
            )


def stream_check_for(device: torch.device) -> StreamCheck | None:
    """A :class:`StreamCheck` for a CUDA device with a real CUDA runtime, else None (CPU, or the
    CUDA path driven under FakeTensorMode on a CPU-only build, where no stream exists)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return StreamCheck(device)
