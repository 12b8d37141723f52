"""One run's capture: the device side a ``Tap`` drives from the training thread.

A :class:`RunCapture` is made at the run's first captured step (when the device is known) and owns
everything that step and the ones after it touch: the metrics in column order, the device ring and
its host arrays, the step clock, the flusher and the NaN guard. Its interface is what the training
thread needs and nothing more:

* :meth:`RunCapture.record` — check one step's inputs, compute its metrics and write its row
  (device ops and host writes only; never a device read); steps shaped like the last checked one
  take the short path built from it (``batchtap.capture.short``);
* :meth:`RunCapture.due` / :meth:`RunCapture.flush` — when to hand rows over, and the
  :class:`~batchtap.capture.flush.Block` that hands them;
* :meth:`RunCapture.poll_nan` — the fast channel's verdict on the losses the device delivered.

It knows nothing of the pipeline, the rules or the sinks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from batchtap.capture.accumulate import MicroBatches, autocast_device
from batchtap.capture.clock import StepClock, clock_for
from batchtap.capture.flush import Block, Flusher
from batchtap.capture.guard import LossGuard
from batchtap.capture.ring import MetricRing
from batchtap.capture.streams import StreamCheck, stream_check_for
from batchtap.errors import ConfigError, InputError
from batchtap.metrics.base import Metric, StepInputs
from batchtap.metrics.gradients import GradNorm
from batchtap.metrics.inputs import (
    check_extra_name,
    check_metrics,
    check_step_inputs,
    device_of,
    meta,
    signature,
    width_mismatch,
)
from batchtap.metrics.layout import Layout
from batchtap.metrics.scalars import Extra

__all__ = [
    "CaptureConfig",
    "RunCapture",
    "autocast_device",
    "check_device_context",
    "accumulate_micro_batch",
    "choose_metrics",
    "compute_values",
    "loader_wait",
    "set_grad_enabled",
]

#: torch's own grad-mode switch (what ``torch.no_grad`` calls), falling back to the public one: a
#: context manager costs ~1 us a step, the bare switch a fraction of that.
set_grad_enabled: Callable[[bool], object] = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)

_GRAPH_CAPTURE = (
    "tap.step()/accumulate() was called while a CUDA graph is being captured on this stream; it writes "
    "host arrays and records events, which a graph cannot hold. Capture the model's step alone, then "
    "call tap.step() on the graph's static outputs after each replay (outside the capture); wrap the "
    "capture in `with tap.paused():` so batchtap's pipeline thread stays off the device meanwhile"
)


@dataclasses.dataclass(frozen=True, slots=True)
class CaptureConfig:
    """The Tap's settings a capture is built from."""

    capacity: int
    flush_every: int
    flush_seconds: float | None  # None: flush on the count only (every rank at the same steps)
    nan_guard: bool
    short_path: bool  # steps may take the short path (no rule actions, no process group, every step sampled)


@dataclasses.dataclass(slots=True)
class RunCapture:
    """Device-side state of one run (see the module docstring)."""

    device: torch.device
    metrics: list[Metric]
    layout: Layout
    ring: MetricRing
    clock: StepClock
    flusher: Flusher
    guard: LossGuard | None
    autocast_device: str
    short_path: bool
    micro: MicroBatches  # device sums of the open optimizer step's micro-batches (accumulate())
    device_metrics: list[Metric]  # every metric in device-column order (a plain step)
    step_metrics: list[Metric]  # metrics computed once per optimizer step, in device-column order
    host_spans: list[tuple[Metric, bool]]  # every metric in host-column order, and whether per micro-batch
    flush_hooks: list[Metric]  # metrics with an on_flush()
    host_readers: list[Metric]  # metrics with host columns, in order
    cuda: bool  # the capture device is a CUDA device (steps check for a graph capture)
    streams: StreamCheck | None  # CUDA: the run's stream, checked at every step
    checked: tuple[Any, ...] | None = None  # signature of the last step() inputs that passed the checks
    checked_micro: tuple[Any, ...] | None = None  # ... of the last accumulate() inputs
    # (loss, outputs, targets, grad_norm, extras) metadata of the last plain step that passed the checks:
    # a step whose inputs fit it takes the short path (capture/short.py); None: no short path
    short_key: tuple[Any, Any, Any, Any, tuple[tuple[str, Any], ...]] | None = None

    @classmethod
    def create(
        cls,
        metrics: Sequence[Metric],
        inputs: StepInputs,
        micro: MicroBatches | None,
        config: CaptureConfig,
        declared_extras: Mapping[str, bool],
    ) -> RunCapture:
        """The capture for a run whose first captured step got ``inputs``.

        Args:
            metrics: the run's chosen metrics (the Tap drops default metrics a run cannot feed).
            inputs: the first step's inputs (they fix the device and the extras' columns).
            micro: the micro-batch sums of an ``accumulate()`` that came before the first step.
            config: ring and flush settings.
            declared_extras: extras declared up front, name -> whether it is a tensor.
        """
        device = micro.device if micro is not None else device_of(inputs)
        metrics = list(metrics)
        if inputs.grad_norm is not None and not any(
            isinstance(m, GradNorm) and m.takes_step_grad_norm for m in metrics
        ):
            metrics.append(GradNorm())  # the loop's own norm (clip_grad_norm_'s return value)
        extras = dict(declared_extras)
        for name, value in inputs.extra.items():
            extras.setdefault(name, isinstance(value, torch.Tensor))
        taken = {o.name for m in metrics for o in m.outputs()}
        for name in extras:
            check_extra_name(name, taken)
        metrics += [Extra(name, on_device=on_device) for name, on_device in extras.items()]
        check_metrics(metrics)
        layout = Layout(metrics)
        if micro is None:
            micro = MicroBatches([sp.metric for sp in layout.device_order if sp.metric.per_micro_batch], device)
        ring = MetricRing(
            capacity=config.capacity,
            device_width=layout.device_width,
            host_width=layout.host_width,
            device=device,
            guard_column=layout.guard_column if config.nan_guard else None,
        )
        clock = clock_for(device, config.capacity)
        flusher = Flusher(ring, clock, flush_every=config.flush_every, flush_seconds=config.flush_seconds)
        return cls(
            device,
            metrics,
            layout,
            ring,
            clock,
            flusher,
            guard=LossGuard(ring, clock) if ring.guard_column is not None else None,
            autocast_device=autocast_device(device),
            short_path=config.short_path,
            micro=micro,
            device_metrics=[sp.metric for sp in layout.device_order],
            step_metrics=[sp.metric for sp in layout.device_order if not sp.metric.per_micro_batch],
            host_spans=[(m, m.per_micro_batch) for m in metrics],
            flush_hooks=[m for m in metrics if type(m).on_flush is not Metric.on_flush],
            host_readers=[m for m in metrics if m.host_width],
            cuda=device.type == "cuda",
            streams=stream_check_for(device),
        )

    @property
    def rows(self) -> int:
        """Rows captured so far in this run."""
        return self.flusher.rows

    # ------------------------------------------------------------------ one step

    def check(self, inputs: StepInputs, accumulated: bool) -> None:
        """Check a ``step()``'s inputs, once per signature (metadata only)."""
        key = (signature(inputs), accumulated)
        if key == self.checked:
            return
        metrics = [m for m in self.metrics if not m.per_micro_batch] if accumulated else self.metrics
        check_step_inputs(inputs, metrics, self.device)
        if inputs.grad_norm is not None and not any(
            isinstance(m, GradNorm) and m.takes_step_grad_norm for m in self.metrics
        ):
            raise InputError(
                "grad_norm= was not passed at the run's first step, which fixes the columns; pass it from "
                "the first step on, or add bt.metrics.GradNorm() to the Tap's metrics"
            )
        self.checked = key

    def record(
        self,
        inputs: StepInputs,
        step: int,
        epoch: int,
        batch: int,
        data_time: float,
        *,
        tokens: float,
        accumulated: bool,
    ) -> None:
        """The general path: check, compute and write one step's row (inputs already carry the device).

        Sets :attr:`short_key` when the step was a plain one (the short path's inputs).
        """
        wall = time.time()
        self.check(inputs, accumulated)
        micro = self.micro
        # Grad mode off: metric ops record no graph and the ring write takes tensors that require grad.
        grad_was = torch.is_grad_enabled()
        set_grad_enabled(False)
        try:
            if accumulated:
                head: torch.Tensor | None = micro.result()
                device_values = self.compute(self.step_metrics, inputs)
                host_values = [
                    v
                    for metric, per_micro in self.host_spans
                    for v in (micro.host.get(id(metric), ()) if per_micro else metric.read_host(inputs))
                ]
                device_count = micro.width + len(device_values)
            else:
                head = None
                device_values = self.compute(self.device_metrics, inputs)
                host_values = [v for metric in self.host_readers for v in metric.read_host(inputs)]
                device_count = len(device_values)
            if device_count != self.layout.device_width or len(host_values) != self.layout.host_width:
                raise ConfigError(width_mismatch(self.metrics, inputs))
            self.write_row(
                device_values,
                host_values,
                step,
                epoch,
                batch,
                data_time,
                wall_time=wall,
                samples=inputs.batch_size,
                tokens=tokens,
                head=head,
            )
        finally:
            set_grad_enabled(grad_was)
        self.short_key = None
        if self.short_path and not accumulated:
            self.short_key = (
                meta(inputs.loss),
                meta(inputs.outputs),
                meta(inputs.targets),
                meta(inputs.grad_norm),
                tuple((name, meta(value)) for name, value in inputs.extra.items()),
            )

    def compute(self, metrics: Sequence[Metric], inputs: StepInputs) -> list[torch.Tensor]:
        """Every metric's device values, in float32 whatever precision the forward pass ran in."""
        return compute_values(metrics, inputs, self.autocast_device)

    def write_row(
        self,
        device_values: list[torch.Tensor],
        host_values: Sequence[float],
        step: int,
        epoch: int,
        batch: int,
        data_time: float,
        *,
        wall_time: float,
        samples: float,
        tokens: float,
        head: torch.Tensor | None = None,
    ) -> None:
        """Write the step's row into its ring slot, with its end mark and NaN-guard entry (grad mode off)."""
        flusher, guard = self.flusher, self.guard
        row = flusher.rows
        slot = flusher.claim(row)
        if guard is not None:
            guard.check_before_reuse(row)  # before the write overwrites the slot's last loss copy
        self.ring.write(
            slot,
            device_values,
            host_values,
            step=step,
            epoch=epoch,
            batch=batch,
            wall_time=wall_time,
            samples=samples,
            data_time=data_time,
            tokens=tokens,
            head=head,
        )
        self.clock.mark_end(slot)
        if guard is not None:
            guard.track(slot, row)
        flusher.commit_row()

    # ------------------------------------------------------------------ between steps

    def arm_start(self) -> None:
        """Mark the start of the next step (in the slot its row will take)."""
        self.clock.mark_start(self.flusher.claim(self.flusher.rows))

    def due(self) -> bool:
        """Whether the unflushed rows call for a flush now."""
        return self.flusher.due()

    def flush(self, *, empty_ok: bool = False) -> Block | None:
        """Queue the device->host copy of every unflushed row; the block that hands them over."""
        block = self.flusher.flush(empty_ok=empty_ok)
        if block is not None:
            for metric in self.flush_hooks:
                metric.on_flush()
        return block

    def poll_nan(self) -> tuple[int, float] | None:
        """(step, loss) of the first non-finite loss the device has delivered, else None."""
        return self.guard.poll() if self.guard is not None else None


def check_device_context(capture: RunCapture | None, *tensors: object) -> None:
    """Refuse a step during a CUDA graph capture or on another stream than the run's (CUDA only;
    before the run's first capture the device is read off ``tensors``)."""
    cuda = (
        capture.cuda
        if capture is not None
        else any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors)
    )
    if not cuda:
        return
    try:
        capturing = torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # no CUDA runtime: the CUDA path driven under FakeTensorMode on a CPU-only build
        capturing = False
    if capturing:
        raise InputError(_GRAPH_CAPTURE)
    if capture is not None and capture.streams is not None:
        capture.streams.check()


def compute_values(metrics: Sequence[Metric], inputs: StepInputs, device_type: str) -> list[torch.Tensor]:
    """Every metric's device values with autocast off on ``device_type`` (metrics stay float32
    whatever precision the forward pass ran in)."""
    if device_type and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return [v for m in metrics for v in m.compute(inputs)]
    return [v for m in metrics for v in m.compute(inputs)]


def choose_metrics(metrics: Sequence[Metric], inputs: StepInputs, *, micro: bool, auto: bool) -> list[Metric]:
    """The per-micro-batch (``micro``) or per-step metrics of a run. With default metrics (``auto``),
    those whose inputs the first call lacks (or that do not fit them, e.g. accuracy of float targets)
    are left out."""
    chosen = [m for m in metrics if m.per_micro_batch == micro]
    return [m for m in chosen if m.applies(inputs)] if auto else chosen


def loader_wait(given: object, watched: float) -> float:
    """One micro-batch's loader wait: the seconds a caller timed itself (``accumulate(data_time=)``,
    e.g. an integration around its own fetch), else the watched loader's (NaN: none measured)."""
    if given is None:
        return watched
    if not (isinstance(given, (int, float)) and type(given) is not bool and math.isfinite(given) and given >= 0):
        raise InputError(
            f"data_time= must be the seconds the loop waited for this micro-batch's data, a finite number >= 0; got "
            f"{given!r}; pass the difference of two time.perf_counter() readings taken around the fetch, or leave it out"
        )
    return float(given)


def accumulate_micro_batch(
    micro: MicroBatches, inputs: StepInputs, *, tokens: int | None, data_time: float, capture: RunCapture | None
) -> None:
    """Check one ``accumulate()`` call's inputs (once per signature) and fold its metrics into ``micro``
    (inputs carry the device; device ops only, no host read)."""
    key = signature(inputs)
    short = capture is not None and key == micro.short_key  # checked when the writers were built
    if not short and (capture is None or key != capture.checked_micro):
        check_step_inputs(inputs, micro.metrics, micro.device, "accumulate()")
        if not micro.metrics and inputs.loss is None:
            raise InputError("accumulate() got nothing to measure; pass the micro-batch's loss (and outputs/targets)")
        if capture is not None:
            capture.checked_micro = key
    micro.add_data_time(data_time)
    grad_was = torch.is_grad_enabled()
    set_grad_enabled(False)  # the bare switch: torch.no_grad() costs a context manager per call
    try:
        if short:
            micro.add_short(inputs, tokens=tokens)
            return
        values = compute_values(micro.metrics, inputs, micro.autocast_device)
        for metric in micro.host_readers:
            micro.host[id(metric)] = metric.read_host(inputs)
        micro.add(values, samples=inputs.batch_size, tokens=tokens)
        if capture is not None:
            micro.offer_short(key, inputs)
    finally:
        set_grad_enabled(grad_was)
