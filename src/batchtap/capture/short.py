"""The short path of ``tap.step()``: one closure per run and input signature.

Most loops call ``tap.step()`` with inputs of the same shapes, dtypes and device at every step.
Steps go through the general path (every check, then the row) until two plain steps in a row have
the same inputs' metadata (``RunCapture.fast_key``); the Tap then builds a :class:`ShortStep` for
it here. Every later step whose inputs fit that metadata runs only this closure: the metrics'
device ops, the ring write, the end mark and NaN-guard entry, the flush check and the next start
mark. A step that does not fit (an epoch's short last batch) takes the general path and leaves the
closure in place; a loop whose shapes change at every step never builds one.

Why a closure and not methods: a step that the model's own step has just pushed out of the CPU's
caches pays for every attribute lookup and call frame again (issue 13 measured the same calls 6-7x
slower in a real loop than alone). Here the objects a step touches are bound once, as locals of the
closure, and the body is one straight frame with three calls to metric code and two to torch.

The closure decides nothing the general path would decide differently: anything it does not
expect (another thread, a pipeline error, open micro-batches, autocast, inputs of other metadata,
other extras, an odd ``batch_size``/``tokens``/``grad_norm``/``epoch``/``batch``) makes it return False
having done nothing, and the Tap takes the general path for that step.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from batchtap.capture.session import RunCapture, check_device_context, set_grad_enabled
from batchtap.metrics.base import StepInputs

__all__ = ["RunPosition", "ShortStep", "short_step"]

#: ``step(loss, outputs, targets, batch_size, tokens, grad_norm, epoch, batch, extra) -> taken``
ShortStep = Callable[[Any, Any, Any, Any, Any, Any, Any, Any, Any], bool]


class RunPosition(Protocol):
    """The Tap's per-run counters as the short path reads and advances them."""

    step: int
    watching: bool
    epoch: int
    batch: int
    data_time: float


class ErrorFlag(Protocol):
    @property
    def has_error(self) -> bool: ...


def _fits(key: Any) -> Callable[[object], bool]:
    """A test that an input has the metadata ``key`` (see ``metrics.inputs.meta``), or is None."""
    if key is type(None):
        return lambda value: value is None
    if type(key) is tuple:
        shape, dtype, device = key
        if device.type == "cpu":
            return lambda value: (
                isinstance(value, torch.Tensor) and value.dtype is dtype and value.shape == shape and value.is_cpu
            )
        return lambda value: (
            isinstance(value, torch.Tensor) and value.dtype is dtype and value.shape == shape and value.device == device
        )
    return lambda value: type(value) is key  # a Python number (grad_norm)


def short_step(
    capture: RunCapture,
    run: RunPosition,
    *,
    owner_thread: int,
    errors: ErrorFlag,
    on_nan: Callable[[tuple[int, float]], None],
    on_due: Callable[[], None],
) -> ShortStep | None:
    """The short path for inputs with the metadata of the capture's last checked plain step.

    Args:
        capture: the run's capture; its ``fast_key`` fixes the inputs (and extras) the closure takes.
        run: the Tap's run counters (``step`` is advanced here).
        owner_thread: the thread that drives the run (another thread takes the general path, which
            refuses it).
        errors: the pipeline's error flag (set: the general path raises the error).
        on_nan: called with (step, loss) when the NaN guard sees a non-finite loss.
        on_due: called when the unflushed rows call for a flush (the Tap hands the block over).

    Returns None when the capture has no short path (see ``CaptureConfig.fast_path``).
    """
    key = capture.fast_key
    if key is None:
        return None
    # which inputs are None is part of the key: one tuple compare settles those, then only the
    # tensors (and a Python-number grad_norm) are checked one by one
    inputs_key, extras_key = key[:4], key[4]
    none_pattern = tuple(k is type(None) for k in inputs_key)
    checks = [(i, _fits(k)) for i, k in enumerate(inputs_key) if k is not type(None)]
    # extras: the same names in the same order (the general path's signature is ordered too), each
    # with its metadata; an int extra too large for a float is left to the general path's error
    extra_names = tuple(name for name, _ in extras_key)
    extra_checks = [(name, _fits(k), k is int) for name, k in extras_key]
    if not checks:  # a step with no inputs at all (host-side metrics only): the pattern says it all
        checks = [(0, lambda value: True)]
    (first_index, first_fits), rest = checks[0], checks[1:]
    # samples come from the inputs' shapes when batch_size is not given, and those are fixed here
    samples_from_shape = math.nan
    for k in key[1:3]:
        if type(k) is tuple and len(k[0]) > 0:
            samples_from_shape = float(k[0][0])
            break
    ring, clock, flusher, guard, micro = capture.ring, capture.clock, capture.flusher, capture.guard, capture.micro
    computes = [m.compute for m in capture.device_metrics]
    only_compute = computes[0] if len(computes) == 1 else None
    host_readers = [m.read_host for m in capture.host_readers]
    device = capture.device
    cuda = capture.cuda
    autocast_device = capture.autocast_device
    capacity, every = ring.capacity, flusher.flush_every
    flush_seconds = flusher.flush_seconds
    rows, facts, host_rows = ring.slot_rows, ring.facts, ring.host_rows
    one_column, no_columns = ring.device_width == 1, ring.device_width == 0
    guard_pairs, non_blocking = ring.guard_pairs, ring.non_blocking
    pending = guard.pending if guard is not None else None
    mark_start, mark_end = clock.mark_start, clock.mark_end
    get_ident, wall_clock, monotonic, nan, stack = threading.get_ident, time.time, time.monotonic, math.nan, torch.stack
    grad_enabled, is_autocast = torch.is_grad_enabled, torch.is_autocast_enabled
    no_host: tuple[float, ...] = ()

    def step(
        loss: Any, outputs: Any, targets: Any, batch_size: Any, tokens: Any, grad_norm: Any, epoch: Any, batch: Any,
        extra: Any,
    ) -> bool:
        if (
            get_ident() != owner_thread
            or errors.has_error
            or micro.count
            or (loss is None, outputs is None, targets is None, grad_norm is None) != none_pattern
        ):
            return False
        given = (loss, outputs, targets, grad_norm)
        if not first_fits(given[first_index]) or (rest and not all(fits(given[i]) for i, fits in rest)):
            return False
        if extra:
            if type(extra) is not dict or tuple(extra) != extra_names:
                return False
            for name, fits, whole in extra_checks:
                value = extra[name]
                if not fits(value) or (whole and not -(2**1023) < value < 2**1023):
                    return False
        elif extra_names:
            return False  # a step without the run's extras: the general path records their absence
        if autocast_device and is_autocast(autocast_device):
            return False  # metrics then run in float32 with autocast off: the general path does that
        if batch_size is None:
            samples = samples_from_shape
        elif type(batch_size) is int and 0 < batch_size < 2**1023:  # a float holds it
            samples = float(batch_size)
        else:
            return False
        if tokens is None:
            step_tokens = nan
        elif type(tokens) is int and 0 < tokens < 2**1023:
            step_tokens = float(tokens)
        else:
            return False
        if type(grad_norm) is int and not -(2**1023) < grad_norm < 2**1023:
            return False  # too large for a float: the general path reports it
        if (epoch is not None and not (type(epoch) is int and epoch >= 0)) or (
            batch is not None and not (type(batch) is int and batch >= 0)
        ):
            return False  # the general path reports it
        if cuda:
            check_device_context(capture)  # raises InputError, as the general path would
        wall = wall_clock()
        inputs = StepInputs(loss, outputs, targets, samples, extra or {}, grad_norm, device)
        grad_was = grad_enabled()
        set_grad_enabled(False)
        try:
            values = only_compute(inputs) if only_compute is not None else [v for c in computes for v in c(inputs)]
            host_values = [v for read in host_readers for v in read(inputs)] if host_readers else no_host
            # the row: its slot (waits only when the pipeline is a whole ring behind), the NaN
            # guard's check of the slot's old row, the device write, host facts, end mark
            row = flusher.rows
            slot = flusher.claim(row) if row - capacity >= flusher.released else row % capacity
            if pending and pending[0][1] <= row - capacity:
                guard.settle(row)  # type: ignore[union-attr]
            if one_column:
                rows[slot].fill_(values[0])
            elif not no_columns:
                stack(values, out=rows[slot])  # type: ignore[arg-type]  # a metric's tuple or list
            if guard_pairs is not None:  # CUDA: the loss's copy for the NaN guard
                target, source = guard_pairs[slot]
                target.copy_(source, non_blocking=non_blocking)
        finally:
            set_grad_enabled(grad_was)
        host_rows[slot] = host_values
        # the step's position: the loop's own epoch=/batch= when given, else the watched loader's,
        # else the step counter (as the general path decides)
        if epoch is None:
            epoch = run.epoch
        if run.watching:
            facts[slot] = (run.step, epoch, run.batch if batch is None else batch, wall, samples, run.data_time, step_tokens)
        else:
            facts[slot] = (run.step, epoch, run.step if batch is None else batch, wall, samples, nan, step_tokens)
        mark_end(slot)
        if pending is not None:
            pending.append((slot, row))
        row += 1
        flusher.rows = row
        run.step += 1
        # after the step: NaN guard, flush, next start mark (as Tap._after_step does)
        if guard is not None:
            hit = guard.poll()
            if hit is not None:
                on_nan(hit)
        if row - flusher.flushed >= every or (
            flush_seconds is not None and monotonic() - flusher.last_flush >= flush_seconds
        ):
            on_due()
        if not run.watching:
            mark_start(flusher.claim(row) if row - capacity >= flusher.released else row % capacity)
        return True

    return step
