"""One open run on the training side: its position, its capture, its pipeline chain, its step path.

The :class:`~batchtap.Tap` is configuration and life cycle; between ``start()`` and ``finish()`` it
holds one :class:`ActiveRun`, which does the run's work on the training thread:

* numbers the batches (``watch``) and takes each step's position (epoch, batch, data wait);
* makes the run's :class:`~batchtap.capture.session.RunCapture` at its first captured step, with
  the pipeline's chain for it, and the short step path once the loop's inputs repeat;
* after each step: polls the NaN guard, hands due blocks to the pipeline (with the ``log()`` values
  of their steps), agrees with the other ranks at flush steps, applies rule verdicts.

Everything flows one way from here: capture below, the pipeline host beside (it only enqueues,
except where a ``# sync:`` label says otherwise); nothing here calls back into the Tap.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from batchtap._names import check_storable
from batchtap._owner import ThreadOwner
from batchtap._resume import resume_point  # re-exported: tap.py imports the run's helpers from here
from batchtap.capture.accumulate import MicroBatches
from batchtap.capture.flush import BlockData
from batchtap.capture.loader import timed_batches
from batchtap.capture.logged import Logged, check_logged, copy_check
from batchtap.capture.session import (
    CaptureConfig,
    RunCapture,
    accumulate_micro_batch,
    check_device_context,
    choose_metrics,
    loader_wait,
)
from batchtap.capture.short import ShortPaths, ShortStep
from batchtap.errors import ConfigError, DistributedError, InputError
from batchtap.metrics.base import Metric, StepInputs
from batchtap.metrics.inputs import check_count, check_scalar, device_of, overflow_message, samples_of
from batchtap.metrics.left_out import warn_left_out
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.messages import BlockRows
from batchtap.pipeline.chain.stages import ReduceSpec
from batchtap.pipeline.ranks.agreement import ProcessGroups, RankAgreement
from batchtap.pipeline.transport.host import PipelineHost
from batchtap.records import Event, EventKind, RunInfo
from batchtap.recovery.actions import ActionRunner

__all__ = ["ActiveRun", "HandedRows", "RunSettings", "report", "resume_point", "run_labels"]

T = TypeVar("T")
log = logging.getLogger("batchtap")


@dataclasses.dataclass(frozen=True, slots=True)
class RunSettings:
    """The Tap's settings a run works with."""

    metrics: tuple[Metric, ...]
    auto_metrics: bool  # default metrics: those a run cannot feed are dropped at its first step
    declared_extras: Mapping[str, bool]
    capacity: int
    flush_every: int
    flush_seconds: float
    sample_every: int
    nan_guard: bool
    per_rank_rows: bool
    loss_rule: bool  # a NonFinite("loss") rule decides what a non-finite loss does (not the guard)


@dataclasses.dataclass(frozen=True)
class HandedRows:
    """Rows a capture outside batchtap's ring (TensorFlow's) read back itself, for ``Tap.hand_over``.

    Every array has one entry per row. ``values``: ``[n, device_width]`` raw columns in the layout
    of the metrics handed with them (the same list at every call of a run); ``offsets``: each
    row's step as an offset from the run's next step (``0, 1, ...``; a gap where rows were lost);
    ``samples`` and ``step_time``: NaN where unknown; ``notes``: events of rows ``(row, kind,
    message)`` (a loss-scale skip).
    """

    values: np.ndarray
    offsets: np.ndarray
    epoch: np.ndarray
    batch: np.ndarray
    samples: np.ndarray
    step_time: np.ndarray
    notes: Sequence[tuple[int, EventKind, str]] = ()


class ActiveRun:
    """See the module docstring. Made by ``Tap.start()``; every method runs on the training thread.

    Attributes:
        info: the run as stored.
        step: global step of the next ``step()`` call (every call, sampled or not).
        short: the short step path, once built (``Tap.step`` calls it first).
    """

    def __init__(
        self,
        info: RunInfo,
        settings: RunSettings,
        pipeline: PipelineHost,
        control: Control,
        runner: ActionRunner | None,
        *,
        first_step: int = 0,
        agreement: RankAgreement | None = None,
        groups: ProcessGroups | None = None,
    ) -> None:
        self.info = info
        self.settings = settings
        self.pipeline = pipeline
        self.control = control
        self.runner = runner
        self.agreement = agreement
        self.groups = groups
        self.rank = agreement.rank if agreement is not None else 0
        self.writes = self.rank == 0  # this process hands records to its sinks (rank 0 in a process group)
        self.step = first_step
        self.next_epoch = 0
        self.watching = False
        # position of the batch the watched loader handed out last: epoch, batch, sampled, data wait
        self.epoch = 0
        self.batch = 0
        self.sampled = True
        self.data_time = math.nan
        self.capture: RunCapture | None = None
        self.chain: Any = None  # the pipeline's handle for this run's blocks, made with the capture
        self.micro: MicroBatches | None = None  # accumulate() before the first step() made the capture
        self.owner = ThreadOwner()  # the one thread that steps
        self.pending_logged: list[Logged] = []  # log() values waiting for the next flush
        self.short: ShortStep | None = None
        self._short_paths = ShortPaths()
        self.outside: tuple[Metric, ...] = ()  # hand_over()'s metrics (a capture outside batchtap's ring)
        self.outside_guard: int | None = None  # their layout's loss column
        self.outside_rows = 0  # rows handed over

    # ------------------------------------------------------------------ the loop

    def watch(self, loader: Iterable[T], epoch: int | None) -> Iterator[T]:
        """See ``Tap.watch``."""
        self.epoch = epoch if epoch is not None else self.next_epoch
        self.next_epoch = self.epoch + 1
        self.watching = True
        try:
            total: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            total = None  # an iterable without a length: progress shows a count, no percentage
        # Through the pipeline queue (no I/O here): progress displays learn the epoch's length.
        self.pipeline.start_epoch(self.info.id, self.epoch, total, writes=self.writes)
        sample_every = self.settings.sample_every
        try:
            for index, (batch, data_time, is_last) in enumerate(timed_batches(loader, sample_every > 1)):
                if self.runner is not None and self.runner.should_skip(
                    self.epoch, index, step=self.step, run_id=self.info.id
                ):
                    self.send(self.runner.take_events())
                    continue  # a rollback asked to skip the batches that led to the divergence
                self.batch = index
                self.data_time = data_time
                self.sampled = index % sample_every == 0 or is_last
                micro = self.capture.micro if self.capture is not None else self.micro
                if self.sampled and (micro is None or micro.count == 0):
                    self.arm_start()  # an optimizer step starts with its first micro-batch
                yield batch
        finally:
            self.watching = False

    def take_step(
        self,
        loss: torch.Tensor | None,
        outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        extra: Mapping[str, torch.Tensor | float] | None,
        batch_size: int | None,
        tokens: int | None,
        grad_norm: torch.Tensor | float | None,
        epoch: int | None,
        batch: int | None,
    ) -> None:
        """``Tap.step``'s general path: every check, then the row (see ``capture/short.py``)."""
        self.owner.check("step()")
        self.raise_pipeline_error()
        micro = self.capture.micro if self.capture is not None else self.micro
        accumulated = micro is not None and micro.count > 0
        if accumulated and (loss is not None or outputs is not None or targets is not None):
            raise InputError(
                "step() got loss/outputs/targets after accumulate() calls in the same optimizer step; pass "
                "every micro-batch (the last one too) to accumulate() and call step() without them"
            )
        if self.watching:
            ep, index, sampled, data_time = self.epoch, self.batch, self.sampled, self.data_time
        else:
            ep, index = self.epoch, self.step
            sampled, data_time = self.step % self.settings.sample_every == 0, math.nan
        if accumulated:
            assert micro is not None
            sampled, data_time = True, micro.data_time  # accumulate() only sums sampled steps
        if epoch is not None:
            check_count("epoch", epoch, minimum=0)
            ep = epoch
        if batch is not None:
            check_count("batch", batch, minimum=0)
            index = batch
        if sampled:
            try:
                self._capture_step(
                    loss, outputs, targets, extra or {}, batch_size, tokens, grad_norm, ep, index, data_time, micro
                )
            except OverflowError:  # nothing was recorded yet: a number too large for a float
                raise InputError(overflow_message(extra or {}, tokens)) from None
        if micro is not None:
            micro.reset()
        self.step += 1
        if self.capture is not None:
            self._after_step(self.capture)

    def _capture_step(
        self,
        loss: torch.Tensor | None,
        outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        extra: Mapping[str, torch.Tensor | float],
        batch_size: int | None,
        tokens: int | None,
        grad_norm: torch.Tensor | float | None,
        epoch: int,
        batch: int,
        data_time: float,
        micro: MicroBatches | None,
    ) -> None:
        if self.capture is None or self.capture.cuda:  # nothing to check on a capture known to be off CUDA
            check_device_context(self.capture, loss, outputs)
        accumulated = micro is not None and micro.count > 0
        if tokens is not None:
            check_count("tokens", tokens)
        if grad_norm is not None:
            check_scalar("grad_norm", grad_norm)
        if accumulated:
            assert micro is not None
            samples = micro.samples if batch_size is None else samples_of(batch_size, None, None)
            step_tokens = micro.tokens if tokens is None else float(tokens)
        else:
            samples = samples_of(batch_size, outputs, targets)
            step_tokens = math.nan if tokens is None else float(tokens)
        capture = self.capture
        if capture is None:
            inputs = StepInputs(loss, outputs, targets, samples, extra, grad_norm)
            capture = self._new_capture(inputs, micro if accumulated else None)
        inputs = StepInputs(loss, outputs, targets, samples, extra, grad_norm, device=capture.device)
        capture.record(inputs, self.step, epoch, batch, data_time, tokens=step_tokens, accumulated=accumulated)
        built = self._short_paths.offer(
            capture,
            self,
            inputs,
            owner_thread=self.owner.ident or 0,
            errors=self.control,
            on_nan=self.on_nan,
            on_due=self.flush,
        )
        if built is not None:
            self.short = built

    def _after_step(self, capture: RunCapture) -> None:
        """What follows every step, captured or not: NaN guard, flush, rule verdicts, next start mark."""
        if capture.guard is not None:
            self.poll_guard()
        if capture.due():
            if self.agreement is not None:
                # Agree before handing the block over: the agreement's collective calls release the
                # GIL, and right after a hand-over the pipeline thread would take it for its decode.
                self._agree()
            self.flush()
        if self.runner is not None:
            if self.agreement is None:
                self.apply_verdicts(self.control.waiting)
            self.runner.after_step(self.step - 1)
        if not self.watching and self.step % self.settings.sample_every == 0:
            self.arm_start()  # last, so the next step's time excludes our own flush

    def accumulate(
        self,
        loss: torch.Tensor | None,
        outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        batch_size: int | None,
        tokens: int | None,
        data_time: float | None = None,
    ) -> None:
        """See ``Tap.accumulate``."""
        self.owner.check("accumulate()")
        self.raise_pipeline_error()
        capture = self.capture
        if capture is None or capture.cuda:  # nothing to check on a capture known to be off CUDA
            check_device_context(capture, loss, outputs)
        if self.step % self.settings.sample_every != 0:
            return  # this optimizer step is not sampled
        samples = samples_of(batch_size, outputs, targets)
        if tokens is not None:
            check_count("tokens", tokens)
        micro = capture.micro if capture is not None else self.micro
        if micro is None:
            first = StepInputs(loss, outputs, targets, samples, {})
            device = device_of(first)
            first = StepInputs(loss, outputs, targets, samples, {}, None, device)
            micro = self.micro = MicroBatches(self._choose(first, micro=True), device)
        wait = self.data_time if self.watching else math.nan
        if data_time is not None:
            wait = loader_wait(data_time, wait)
        accumulate_micro_batch(
            micro,
            StepInputs(loss, outputs, targets, samples, {}, None, micro.device),
            tokens=tokens,
            data_time=wait,
            capture=capture,
        )

    def log(self, values: Mapping[str, torch.Tensor | float], step: int | None, epoch: int | None = None) -> None:
        """See ``Tap.log``."""
        self.owner.check("log()")
        check_logged(values, step, taken=self.capture.layout.names if self.capture is not None else ())
        if epoch is not None:
            check_count("epoch", epoch, minimum=0)
        if step is None:
            step = max(self.step - 1, 0)
        clock = self.capture.clock if self.capture is not None else None
        logged = Logged.capture(
            values,
            step=step,
            epoch=self.epoch if epoch is None else epoch,
            wall_time=time.time(),
            marker=lambda: copy_check(clock, values),
        )
        if self.capture is not None and self.agreement is None:
            # Handed over with the next flush, after the block of the steps before it: no flush of
            # its own (a Lightning module logging on every step would otherwise flush every step).
            self.pending_logged.append(logged)
        else:  # before the first step, or in a process group (which flushes at agreed steps only)
            self.pipeline.logged(logged, run_id=self.info.id, rank=self.rank, writes=self.writes)

    # ------------------------------------------------------------------ between steps

    def raise_pipeline_error(self) -> None:
        """Raise what the pipeline reported (a failure, or an input error only values revealed)."""
        error = self.control.take_error()
        if error is not None:
            raise error

    def _choose(self, inputs: StepInputs, *, micro: bool) -> list[Metric]:
        return choose_metrics(self.settings.metrics, inputs, micro=micro, auto=self.settings.auto_metrics)

    def _new_capture(self, inputs: StepInputs, micro: MicroBatches | None) -> RunCapture:
        """Make the run's capture at its first captured step, and the pipeline's chain for it."""
        device = micro.device if micro is not None else device_of(inputs)
        inputs = dataclasses.replace(inputs, device=device)
        chosen = {id(m) for m in (micro.metrics if micro is not None else self._choose(inputs, micro=True))}
        chosen |= {id(m) for m in self._choose(inputs, micro=False)}
        settings = self.settings
        config = CaptureConfig(
            capacity=settings.capacity,
            flush_every=settings.flush_every,
            flush_seconds=None if self.agreement else settings.flush_seconds,  # ranks flush at the same steps
            nan_guard=settings.nan_guard,
            short_path=settings.sample_every == 1 and self.agreement is None and self.runner is None,
        )
        metrics = [m for m in settings.metrics if id(m) in chosen]
        capture = RunCapture.create(metrics, inputs, micro, config, settings.declared_extras)
        reduce = None
        if self.agreement is not None and self.groups is not None:
            reduce = ReduceSpec(self.groups.reduce, self.rank, self.agreement.world_size, settings.per_rank_rows)
        self.chain = self.pipeline.open_chain(
            capture.layout,
            run_id=self.info.id,
            rank=self.rank,
            writes=self.writes,
            reduce=reduce,
            max_rows=settings.capacity,  # a block never holds more than a ring
        )
        self.capture = capture
        self.micro = None  # the capture owns it from here
        self.info.metrics = capture.layout.names
        self.info.environment["device"] = str(device)  # known from the first step; stored with the run's end
        if settings.auto_metrics and self.writes:  # a default metric left out for a fixable reason: said once
            warn_left_out(self, settings.metrics, chosen, inputs)
        return capture

    def hand_over(self, metrics: Sequence[Metric], rows: HandedRows) -> int:
        """See ``Tap.hand_over`` and :class:`HandedRows`."""
        n = len(rows.offsets)
        data = BlockData(
            device_values=np.asarray(rows.values, dtype=np.float64).reshape(n, -1),
            host_values=np.zeros((n, 0)),
            step=np.asarray(rows.offsets, dtype=np.int64),
            epoch=np.asarray(rows.epoch, dtype=np.int64),
            batch=np.asarray(rows.batch, dtype=np.int64),
            wall_time=np.full(n, time.time()),
            samples=np.asarray(rows.samples, dtype=np.float64),
            data_time=np.full(n, math.nan),
            tokens=np.full(n, math.nan),
            step_time=np.asarray(rows.step_time, dtype=np.float64),
        )
        notes = rows.notes
        self.owner.check("hand_over()")
        self.raise_pipeline_error()
        if self.agreement is not None:
            raise ConfigError("Tap.hand_over() (TensorFlow capture) does not support torch.distributed process groups")
        if self.capture is not None:
            raise ConfigError("Tap.hand_over() cannot be mixed with Tap.step() in one run; use one capture per run")
        metrics = tuple(metrics)
        if self.chain is None:
            from batchtap.metrics.layout import Layout

            layout = Layout(metrics)
            self.chain = self.pipeline.open_chain(
                layout, run_id=self.info.id, rank=self.rank, writes=self.writes, reduce=None
            )
            self.outside = metrics
            self.outside_guard = layout.guard_column
            self.info.metrics = layout.names
        elif metrics != self.outside:
            raise ConfigError(
                "Tap.hand_over() got other metrics than at the run's first hand-over; keep one list per run"
            )
        if len(data) == 0:
            return self.step
        first = self.step
        data = dataclasses.replace(data, step=first + np.asarray(data.step, dtype=np.int64))
        self.step = int(data.step[-1]) + 1
        self.outside_rows += len(data)
        self.epoch = int(data.epoch[-1])  # log() after these rows (val_* at an epoch's end) carries their epoch
        pending, self.pending_logged = self.pending_logged, []
        self.pipeline.send(BlockRows(self.chain, data))
        for logged in pending:
            self.pipeline.logged(logged, run_id=self.info.id, rank=self.rank, writes=self.writes)
        if notes:
            now = time.time()
            self.send(
                [
                    Event(self.info.id, int(data.step[i]), kind, message, now, rank=self.rank)
                    for i, kind, message in notes
                ]
            )
        guard = self.outside_guard
        if self.settings.nan_guard and guard is not None:
            # the guard of a PyTorch step, on the host copy: the first non-finite loss stops the run
            # (or, with a NonFinite("loss") rule, lets the rules decide)
            bad = np.flatnonzero(~np.isfinite(data.device_values[:, guard]))
            if bad.size and not self.settings.loss_rule:
                i = int(bad[0])
                self.on_nan((int(data.step[i]), float(data.device_values[i, guard])))
            elif bad.size and self.runner is not None:
                # sync: rare path — a non-finite loss was seen; wait for the rules' verdict on it.
                self.pipeline.drain()
        if self.runner is not None:
            self.apply_verdicts(self.control.waiting)
        return first

    def arm_start(self) -> None:
        if self.capture is not None:  # the ring is made at the first step; that step has no measured start
            self.capture.arm_start()

    def flush(self, *, empty_ok: bool = False) -> None:
        """Hand the unflushed rows to the pipeline, with the ``log()`` values of their steps."""
        capture = self.capture
        assert capture is not None
        block = capture.flush(empty_ok=empty_ok)
        pending, self.pending_logged = self.pending_logged, []
        if block is not None:
            # log() values travel with the block of the steps they follow: stored in one write, so
            # a reader never sees those steps without them (nor them before those steps).
            self.pipeline.submit(block, self.chain, pending)
        else:
            for logged in pending:
                self.pipeline.logged(logged, run_id=self.info.id, rank=self.rank, writes=self.writes)

    def poll_guard(self) -> None:
        if self.capture is not None:
            hit = self.capture.poll_nan()
            if hit is not None:
                self.on_nan(hit)

    def on_nan(self, hit: tuple[int, float]) -> None:
        """The NaN guard saw a non-finite loss: stop, or let a NonFinite("loss") rule decide."""
        if self.control.local_stop is not None:
            return
        step, value = hit
        if self.settings.loss_rule:
            if self.agreement is None:
                # The rules own this decision: hand them the row now and let them decide before
                # the next step (in a process group they decide at the next flush step instead).
                self.flush()
                # sync: rare path — a non-finite loss was seen; wait for the rules' verdict on it.
                self.pipeline.drain()
                self.apply_verdicts(self.control.waiting)
            return
        self.request_stop(f"non-finite loss {value!r} at step {step}", step=step, metric="loss")

    def request_stop(self, reason: str, *, step: int | None = None, metric: str | None = None) -> None:
        """See ``Tap.request_stop``."""
        step = step if step is not None else self.step - 1
        if not self.control.request_stop(reason, step):
            return
        event = Event(
            self.info.id, step, EventKind.ACTION, f"stop: {reason}", time.time(), metric=metric, rank=self.rank
        )
        self.send([event])
        if self.agreement is None:
            self.control.agree_stop(reason)  # one process: nobody to agree with

    def _agree(self) -> None:
        """At a flush step: agree with every rank on stopping and on the rule verdicts to apply."""
        assert self.agreement is not None
        try:
            agreed = self.agreement.exchange(self.control, self.step - 1)
        except DistributedError:
            if self.chain is not None:
                self.pipeline.ranks_failed(self.chain, "the agreement exchange failed")
            raise
        if self.runner is not None:
            self.apply_verdicts(agreed)  # every rank applies the same verdicts at this step

    def apply_verdicts(self, count: int) -> None:
        """Apply the next ``count`` rule verdicts."""
        runner = self.runner
        assert runner is not None
        stop: str | None = None
        try:
            for verdict in self.control.take_verdicts(count):
                outcome = runner.apply(verdict.decisions, step=self.step - 1, cleared_through=verdict.cleared_through)
                stop = stop or outcome.reason
        finally:
            self.send(runner.take_events())
        if stop is not None and self.control.local_stop is None:
            self.request_stop(stop)
            # every rank applied the same verdicts at this same step: the stop is already agreed
            self.control.agree_stop(stop)

    def send(self, events: Sequence[Event]) -> None:
        self.pipeline.events(list(events), self.chain)

    # ------------------------------------------------------------------ the end

    def close(self) -> None:
        """Before the run's end is stored: the last block, and the run's final metric names."""
        if self.agreement is not None:
            self.agreement.close()
        if self.capture is not None:
            # in a process group an empty last block still carries late events through the reducer
            self.flush(empty_ok=self.agreement is not None)
            self.info.metrics = self.capture.layout.names
        self.short = None


def report(run: ActiveRun | None, message: str, *, info: bool = False) -> None:
    """Store ``message`` as an event of the open run (none: only logged). A warning (the library
    degraded) is also logged as one; a note (``info``: a choice or assumption it made) only at
    DEBUG, so the console sink's line is the one place it is printed, once."""
    if info:
        log.debug("batchtap: %s", message)
    else:
        log.warning("batchtap: %s", message)
    if run is not None:
        kind = EventKind.INFO if info else EventKind.WARNING
        run.send([Event(run.info.id, max(run.step - 1, 0), kind, message, time.time(), rank=run.rank)])


def run_labels(tags: Sequence[str], notes: str | None) -> dict[str, Any]:
    """``tags=`` and ``notes=`` checked, as the run's environment keeps them (where the store's
    readers and ``batchtap tag`` find them)."""
    if not isinstance(tags, (list, tuple)) or not all(isinstance(tag, str) for tag in tags):
        raise InputError(f"tags must be a list of strings, got {tags!r}; e.g. tags=['sweep', 'lr-0.01']")
    if notes is not None and not isinstance(notes, str):
        raise InputError(f"notes must be a string or None, got {type(notes).__name__}")
    labels: dict[str, Any] = {}
    if tags:
        for tag in tags:
            check_storable("tag", tag)
        labels["tags"] = list(dict.fromkeys(tags))
    if notes:
        check_storable("notes", notes)
        labels["notes"] = notes
    return labels
