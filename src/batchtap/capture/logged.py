"""Values given to ``Tap.log()``: evaluation and epoch-level numbers, captured without a host read.

Python numbers are kept as they are. Tensors are copied into a small host buffer (page-locked on
CUDA, ``non_blocking``) and a marker is recorded after the copy; the pipeline thread reads the buffer
only once the marker completed, exactly as it reads flushed ring rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from batchtap.capture.clock import StepClock
from batchtap.capture.ring import _real_memory, host_buffer
from batchtap.errors import InputError
from batchtap.metrics.inputs import check_count, check_new_name, check_scalar
from batchtap.records import Record

__all__ = ["Logged", "check_logged", "copy_check"]


@dataclasses.dataclass(slots=True)
class Logged:
    """One ``Tap.log()`` call on its way to the host.

    Attributes:
        step: the training step the values refer to.
        epoch: the epoch at that step.
        wall_time: ``time.time()`` of the call.
        numbers: values given as Python numbers.
        tensor_names: names of the values given as tensors, in ``host`` order.
        host: float32 host buffer the tensors were copied into (None when there were none).
        done: True once the copy into ``host`` completed (polled on the pipeline thread).
    """

    step: int
    epoch: int
    wall_time: float
    numbers: dict[str, float]
    tensor_names: tuple[str, ...] = ()
    host: torch.Tensor | None = None
    done: Callable[[], bool] = lambda: True

    @classmethod
    def capture(
        cls,
        values: Mapping[str, torch.Tensor | float],
        *,
        step: int,
        epoch: int,
        wall_time: float,
        marker: Callable[[], Callable[[], bool]],
    ) -> Logged:
        """Queue the copies of the tensor values; ``marker()`` records a completion marker after them
        and returns its "done?" check (called only when some tensor is on a non-CPU device)."""
        numbers = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
        tensors = [(k, v) for k, v in values.items() if isinstance(v, torch.Tensor)]
        if not tensors:
            return cls(step, epoch, wall_time, numbers)
        pin = any(t.device.type == "cuda" for _, t in tensors)
        with _real_memory():
            host = host_buffer((len(tensors),), pin=pin)
        for i, (_, t) in enumerate(tensors):
            # a queued copy (the value is cast to float32 on the way); never a host read
            host.narrow(0, i, 1).copy_(t.detach().reshape(1), non_blocking=pin and t.device.type == "cuda")
        device_copy = any(t.device.type != "cpu" for _, t in tensors)
        done = marker() if device_copy else (lambda: True)
        return cls(step, epoch, wall_time, numbers, tuple(k for k, _ in tensors), host, done)

    def values(self) -> dict[str, float]:
        """Every value as a float. Pipeline thread only, once :attr:`done` says the copy completed."""
        out = dict(self.numbers)
        if self.host is not None:
            # sync: none — pipeline thread, host memory whose copy the marker showed complete
            out.update(zip(self.tensor_names, self.host.numpy().tolist()))
        return out

    def record(self, run_id: str, rank: int) -> Record:
        """The sparse record these values are stored as (pipeline side, once :attr:`done`)."""
        return Record(run_id, self.step, self.epoch, -1, rank, self.wall_time, self.values(), sparse=True)


def check_logged(values: object, step: object, *, taken: Collection[str]) -> None:
    """Check a ``Tap.log()`` call: a non-empty mapping of new names to numbers or 0-dim tensors
    (``taken``: the run's per-step value names)."""
    if not isinstance(values, Mapping) or not values:
        raise InputError(f"log() takes a non-empty mapping of name -> number or 0-dim tensor, got {values!r}")
    if step is not None:
        check_count("step", step, minimum=0)
    for name, value in values.items():
        check_new_name(
            "log() name",
            name,
            taken,
            "log() name {name!r} is already a per-step value or record field of this run; log it under "
            "another name, e.g. 'eval_{name}'",
        )
        check_scalar(f"log() value {name!r}", value)


def copy_check(clock: StepClock | None, values: Mapping[str, Any]) -> Callable[[], bool]:
    """A "copy done?" check for ``Tap.log()`` tensors on a device: a marker of the run's clock when
    the capture exists, else a fresh CUDA event."""
    if clock is not None:
        marker = clock.block_marker()
        return lambda: clock.marker_done(marker)
    device = next(v.device for v in values.values() if isinstance(v, torch.Tensor) and v.device.type != "cpu")
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
        return event.query
    # sync: log() before the run's first step, on a device without CUDA events: wait for the copies.
    torch.accelerator.synchronize(device)
    return lambda: True
