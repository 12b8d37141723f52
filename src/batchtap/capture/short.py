"""The short path of ``tap.step()``: one closure per run and input signature.

Most loops call ``tap.step()`` with inputs of the same shapes, dtypes and device at every step.
Steps go through the general path (every check, then the row) until two plain steps in a row have
the same inputs' metadata (``RunCapture.short_key``); the Tap then builds a :class:`ShortStep` for
it here. Every later step whose inputs fit that metadata runs only this closure: the metrics'
device ops, the ring write, the end mark and NaN-guard entry, the flush check and the next start
mark. A step that does not fit (an epoch's short last batch) takes the general path and leaves the
closure in place; a loop whose shapes change at every step never builds one.

Why a closure and not methods: a step that the model's own step has just pushed out of the CPU's
caches pays for every attribute lookup and call frame again (the same calls measured 6-7x slower in
a real loop than alone). Here the objects a step touches are bound once, as locals of the
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
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from batchtap.capture.session import RunCapture, check_device_context, set_grad_enabled
from batchtap.metrics.base import StepInputs

__all__ = ["NO_EXTRAS", "RunPosition", "ShortPaths", "ShortStep", "short_step"]

#: the extras of a step that passes none (shared: nothing writes to it)
NO_EXTRAS: Mapping[str, Any] = types.MappingProxyType({})

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


class ShortPaths:
    """When a run builds its short path: at the second plain step in a row with one input signature.

    A loop whose shapes change every step (dynamic padding) never builds a closure it would not use,
    and an epoch's short last batch leaves the closure of the common shape in place.
    """

    def __init__(self) -> None:
        self._key: object = None  # the signature the current closure was built for
        self._candidate: object = None  # (signature, step) of the last general-path plain step

    def offer(
        self,
        capture: RunCapture,
        run: RunPosition,
        inputs: StepInputs,
        *,
        owner_thread: int,
        errors: ErrorFlag,
        on_nan: Callable[[tuple[int, float]], None],
        on_due: Callable[[], None],
    ) -> ShortStep | None:
        """After a general-path step was recorded (``run.step`` is still that step's): a new closure
        when this step settles a signature, else None (the current one, if any, stays)."""
        key = capture.short_key
        if key is None or key == self._key:
            return None
        built = None
        if self._candidate == (key, run.step - 1):
            self._key = key
            built = short_step(
                capture, run, inputs, owner_thread=owner_thread, errors=errors, on_nan=on_nan, on_due=on_due
            )
        self._candidate = (key, run.step)
        return built


def _fits(key: Any) -> Callable[[object], bool]:
    """A test that an input has the metadata ``key`` (see ``metrics.inputs.meta``)."""
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
    example: StepInputs,
    *,
    owner_thread: int,
    errors: ErrorFlag,
    on_nan: Callable[[tuple[int, float]], None],
    on_due: Callable[[], None],
) -> ShortStep | None:
    """The short path for inputs with the metadata of the capture's last checked plain step.

    Args:
        capture: the run's capture; its ``short_key`` fixes the inputs (and extras) the closure takes.
        run: the Tap's run counters (``step`` is advanced here).
        example: the inputs of that step (the metrics' row writers are made for their metadata).
        owner_thread: the thread that drives the run (another thread takes the general path, which
            refuses it).
        errors: the pipeline's error flag (set: the general path raises the error).
        on_nan: called with (step, loss) when the NaN guard sees a non-finite loss.
        on_due: called when the unflushed rows call for a flush (the Tap hands the block over).

    Returns None when the capture has no short path (see ``CaptureConfig.short_path``).
    """
    key = capture.short_key
    if key is None:
        return None
    # which inputs are None is part of the key: one tuple compare settles those, then only the
    # tensors (and a Python-number grad_norm) are checked one by one
    # None where the input must be None (a plain `is None` then, no call)
    fits_loss, fits_outputs, fits_targets, fits_norm = (None if k is type(None) else _fits(k) for k in key[:4])
    # extras: the same names in the same order (the general path's signature is ordered too), each
    # with its metadata; an int extra too large for a float is left to the general path's error
    extra_names = tuple(name for name, _ in key[4])
    extra_checks = [(name, _fits(k), k is int) for name, k in key[4]]
    # samples come from the inputs' shapes when batch_size is not given, and those are fixed here
    samples_from_shape = math.nan
    for k in key[1:3]:
        if type(k) is tuple and len(k[0]) > 0:
            samples_from_shape = float(k[0][0])
            break
    ring, clock, flusher, guard, micro = capture.ring, capture.clock, capture.flusher, capture.guard, capture.micro
    # each device metric writes its own columns of the row in place (see Metric.row_writer)
    writers = ring.slot_writers(
        [
            span.metric.row_writer(example, ring.device_rows.narrow(1, span.device_offset, span.metric.device_width))
            for span in capture.layout.device_order
            if span.metric.device_width
        ]
    )
    host_readers = [m.read_host for m in capture.host_readers]
    # host values that depend on the inputs' metadata only are read once, here
    fixed_host: list[float] | None = None
    if all(m.host_fixed_by_metadata for m in capture.host_readers):
        fixed_host = [v for read in host_readers for v in read(example)]
    device, cuda, autocast_device = capture.device, capture.cuda, capture.autocast_device
    facts, host_rows, write_with = ring.facts, ring.host_rows, ring.write_with
    claim, due, mark_start, mark_end = flusher.claim, flusher.due, clock.mark_start, clock.mark_end
    get_ident, wall_clock, nan = threading.get_ident, time.time, math.nan
    grad_enabled, is_autocast = torch.is_grad_enabled, torch.is_autocast_enabled

    def step(
        loss: Any,
        outputs: Any,
        targets: Any,
        batch_size: Any,
        tokens: Any,
        grad_norm: Any,
        epoch: Any,
        batch: Any,
        extra: Any,
    ) -> bool:
        if (
            get_ident() != owner_thread
            or errors.has_error
            or micro.count
            or not (loss is None if fits_loss is None else fits_loss(loss))
            or not (outputs is None if fits_outputs is None else fits_outputs(outputs))
            or not (targets is None if fits_targets is None else fits_targets(targets))
            or not (grad_norm is None if fits_norm is None else fits_norm(grad_norm))
        ):
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
        else:
            extra = NO_EXTRAS
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
        inputs = StepInputs(loss, outputs, targets, samples, extra, grad_norm, device)
        grad_was = grad_enabled()
        set_grad_enabled(False)
        try:
            if fixed_host is not None:
                host_values: Sequence[float] = fixed_host
            else:
                host_values = [v for read in host_readers for v in read(inputs)]
            # the row, as RunCapture.write_row writes it: its slot, the NaN guard's check of the
            # slot's old row, the device write, host facts, end mark, guard entry
            row = flusher.rows
            slot = claim(row)
            if guard is not None:
                guard.check_before_reuse(row)
            write_with(slot, writers, inputs)
        finally:
            set_grad_enabled(grad_was)
        host_rows[slot] = host_values
        # the step's position: the loop's own epoch=/batch= when given, else the watched loader's,
        # else the step counter (as the general path decides)
        if epoch is None:
            epoch = run.epoch
        if run.watching:
            facts[slot] = (
                run.step,
                epoch,
                run.batch if batch is None else batch,
                wall,
                samples,
                run.data_time,
                step_tokens,
            )
        else:
            facts[slot] = (run.step, epoch, run.step if batch is None else batch, wall, samples, nan, step_tokens)
        mark_end(slot)
        if guard is not None:
            guard.track(slot, row)
        flusher.rows = row + 1
        run.step += 1
        # after the step, as Tap._after_step: NaN guard, flush, next start mark
        if guard is not None:
            hit = guard.poll()
            if hit is not None:
                on_nan(hit)
        if due():
            on_due()
        if not run.watching:
            mark_start(claim(row + 1))
        return True

    return step
