"""The ``Tap``: the object a training loop talks to.

A ``Tap`` owns the capture side (a device ring per run, its clock, flusher and NaN guard) and the host
pipeline (one thread that decodes, validates and hands blocks to the sink workers). Per step the
training thread only launches a few small device ops and writes host arrays; it never reads a device
value.

Example:
    >>> import torch, batchtap as bt
    >>> model = torch.nn.Linear(4, 3)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> tap = bt.Tap(sinks=[], flush_every=4)
    >>> with tap, tap.run(name="doctest"):
    ...     for _ in range(10):
    ...         x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    ...         out = model(x)
    ...         loss = torch.nn.functional.cross_entropy(out, y)
    ...         opt.zero_grad(); loss.backward(); opt.step()
    ...         tap.step(loss=loss, outputs=out, targets=y)
    >>> tap.steps_recorded
    10
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from batchtap import _env
from batchtap.capture.clock import StepClock, clock_for
from batchtap.capture.flush import Flusher
from batchtap.capture.guard import LossGuard
from batchtap.capture.loader import timed_batches
from batchtap.capture.ring import MetricRing
from batchtap.errors import ConfigError, DistributedError, InputError, RunStateError
from batchtap.metrics.base import Metric, StepInputs
from batchtap.metrics.builtin import Extra, default_metrics
from batchtap.metrics.layout import Layout
from batchtap.pipeline import _dist
from batchtap.pipeline.decode import Decoded, Decoder
from batchtap.pipeline.dispatch import Backpressure, Dispatcher
from batchtap.pipeline.harvest import Harvester, RunPipeline
from batchtap.pipeline.reduce import Reducer, new_group
from batchtap.pipeline.resilient import ResilientSink
from batchtap.records import ALL_RANKS, Event, EventKind, RunInfo, RunStatus
from batchtap.rules.actions import ActionRunner
from batchtap.rules.builtin import NonFinite
from batchtap.rules.engine import Decision, RuleEngine, RuleLike
from batchtap.rules.rollback import Rollback
from batchtap.sinks.base import Sink

__all__ = ["Tap"]

T = TypeVar("T")

#: Record fields that metric and extra names may not shadow.
RESERVED_NAMES = frozenset({"run_id", "step", "epoch", "batch", "rank", "wall_time"})


@dataclasses.dataclass(slots=True)
class _Capture:
    """Device-side state of one run, made at its first captured step (when the device is known)."""

    device: torch.device
    metrics: list[Metric]
    layout: Layout
    ring: MetricRing
    clock: StepClock
    flusher: Flusher
    guard: LossGuard | None
    pipeline: RunPipeline
    autocast_device: str
    checked: tuple[Any, ...] | None = None  # signature of the last inputs that passed the checks


class _Terminated(BaseException):
    """SIGTERM arrived inside ``run()`` (a BaseException, like KeyboardInterrupt, so training code's
    ``except Exception`` does not swallow it)."""


@dataclasses.dataclass(slots=True)
class _Group:
    """This process's place in a process group, and batchtap's own gloo groups."""

    rank: int
    world_size: int
    agreement: Any  # training thread: stop agreement at flush steps
    reduce: Any  # pipeline thread: one exchange per flushed block
    agree: torch.Tensor  # [2, 3]: per buffer [stop?, -lowest stopping rank, -rule messages received]
    agree_np: Any  # numpy view of ``agree``: read without a torch host read
    turn: int = 0  # the buffer of the exchange in flight
    pending: Any = None  # that exchange's Work, completed at the next flush


@dataclasses.dataclass(slots=True)
class _RunState:
    info: RunInfo
    step: int = 0  # global step: every step() call, sampled or not
    next_epoch: int = 0
    watching: bool = False
    # position of the batch the watched loader handed out last: epoch, batch, sampled, data wait
    epoch: int = 0
    batch: int = 0
    sampled: bool = True
    data_time: float = math.nan
    capture: _Capture | None = None
    group: _Group | None = None  # process-group facts, None outside a process group


class Tap:
    """Captures per-batch metrics on the device and streams them to sinks.

    Args:
        metrics: what to measure. Default: :func:`batchtap.metrics.default_metrics` (loss, top-1
            accuracy, timings, throughput, memory, plus lr and grad norm when ``optimizer`` /
            ``model`` are given); default metrics whose inputs a step lacks are dropped.
        sinks: where records go. Default: a :class:`~batchtap.sinks.Console`. ``[]`` for none.
        flush_every: copy captured rows to the host after this many recorded steps.
        flush_seconds: ... or when the oldest unflushed row is this many seconds old.
        sample_every: record every N-th batch (and always the last batch of a watched epoch).
        capacity: ring slots; default ``4 * flush_every``, at least ``2 * flush_every``.
        nan_guard: watch the loss every step through the fast channel; a non-finite loss sets
            :attr:`should_stop` within the device's lag (at the same step on the CPU).
        extras: names of values passed later as ``step(extra=...)``, mapped to ``"tensor"`` or
            ``"number"`` (a plain sequence means tensors). Extras seen at the first step are added
            automatically.
        optimizer: adds :class:`~batchtap.metrics.LearningRate` to the default metrics.
        model: adds :class:`~batchtap.metrics.GradNorm` to the default metrics.
        queue_size: blocks queued per sink before ``backpressure`` applies.
        backpressure: ``"block"`` (lose nothing) or ``"drop_oldest"`` (never wait on sinks).
        rules: anomaly rules (see :mod:`batchtap.rules`), run on the pipeline thread on every
            block of records; their actions are applied on the training thread at its next step.
        rollback: the :class:`~batchtap.rules.Rollback` that ``rollback`` actions restore from.
        spool_dir: wrap every sink in a :class:`~batchtap.pipeline.resilient.ResilientSink` that
            spools to this folder while the sink fails and replays when it recovers (or at the next
            start), so an outage loses nothing.
        handle_sigterm: inside ``run()``, turn SIGTERM into a final flush (run stored as
            ``stopped``), then end the process as SIGTERM would.
        per_rank_rows: in a process group, also store every rank's own rows (``rank`` column)
            besides the reduced ones.
        collective_timeout: seconds a cross-rank exchange may take before the run fails with
            :class:`~batchtap.DistributedError` instead of hanging (a rank died or stalled).

    In an initialized ``torch.distributed`` process group every rank runs the same code: rows are
    flushed at the same steps (``flush_seconds`` is not used there), reduced over ranks on
    batchtap's own gloo groups, and written by rank 0 only. Stop decisions (NaN guard, rules) are
    agreed at flush steps, so every rank stops at the same step.
    """

    def __init__(
        self,
        metrics: Sequence[Metric] | None = None,
        sinks: Sequence[Sink] | None = None,
        *,
        flush_every: int = 50,
        flush_seconds: float = 1.0,
        sample_every: int = 1,
        capacity: int | None = None,
        nan_guard: bool = True,
        extras: Mapping[str, Literal["tensor", "number"]] | Sequence[str] = (),
        optimizer: torch.optim.Optimizer | None = None,
        model: torch.nn.Module | None = None,
        queue_size: int = 64,
        backpressure: Backpressure = "block",
        rules: Sequence[RuleLike] = (),
        rollback: Rollback | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        handle_sigterm: bool = True,
        per_rank_rows: bool = False,
        collective_timeout: float = 300.0,
    ) -> None:
        _check_int("flush_every", flush_every, 1)
        _check_int("sample_every", sample_every, 1)
        _check_int("queue_size", queue_size, 1)
        if not (isinstance(flush_seconds, (int, float)) and flush_seconds > 0):
            raise ConfigError(f"flush_seconds must be > 0, got {flush_seconds!r}")
        capacity = 4 * flush_every if capacity is None else capacity
        _check_int("capacity", capacity, 1)
        if capacity < 2 * flush_every:
            raise ConfigError(
                f"capacity must be >= 2 * flush_every = {2 * flush_every} so rows are never overwritten "
                f"before their copy ran, got {capacity}; raise capacity or lower flush_every"
            )
        self.flush_every = flush_every
        self.flush_seconds = float(flush_seconds)
        self.sample_every = sample_every
        self.capacity = capacity
        self.nan_guard = nan_guard
        self.per_rank_rows = per_rank_rows
        if not (isinstance(collective_timeout, (int, float)) and collective_timeout > 0):
            raise ConfigError(f"collective_timeout must be > 0 seconds, got {collective_timeout!r}")
        self.collective_timeout = float(collective_timeout)
        self._groups: tuple[Any, Any] | None = None  # (agreement, reduction) gloo groups, made once
        self._engine = RuleEngine(rules) if rules or rollback is not None else None
        self._runner = ActionRunner(self._engine, rollback=rollback) if self._engine is not None else None
        # a NonFinite("loss") rule takes over the NaN guard's default stop: the guard then only
        # flushes at once, so the rule's own action (e.g. rollback) follows within a step or two
        self._loss_rule = any(isinstance(r, NonFinite) and r.metric == "loss" for r in rules)
        # decisions from the pipeline thread, in order: (decisions, cleared_through)
        self._inbox: collections.deque[tuple[list[Decision], int]] = collections.deque()
        self._applied = 0  # inbox messages applied so far in this run
        self._auto_metrics = metrics is None
        self._metrics = list(default_metrics(optimizer, model) if metrics is None else metrics)
        _check_metrics(self._metrics)
        self._declared_extras = _declared_extras(extras, self._metrics)
        if sinks is None:
            from batchtap.sinks.console import Console

            sinks = [Console()]
        for sink in sinks:
            if not callable(getattr(sink, "write", None)):
                raise ConfigError(f"sinks must be batchtap.sinks.Sink objects, got {type(sink).__name__}")
        self.sinks = list(sinks)
        if spool_dir is not None:
            self.sinks = [
                ResilientSink(sink, spool_path=Path(spool_dir) / f"{i:02d}-{type(sink).__name__.lower()}.rank{_dist.rank()}.jsonl")
                for i, sink in enumerate(self.sinks)
            ]
        self.handle_sigterm = handle_sigterm
        self._dispatcher = Dispatcher(self.sinks, maxsize=queue_size, policy=backpressure)
        self._harvester = Harvester(self._dispatcher, on_block=[self._on_block], on_error=self._on_pipeline_error)
        self._block_hooks = self._harvester.on_block  # rules add theirs here
        self._state: _RunState | None = None
        self._last_decoder: Decoder | None = None
        self._stop_reason: str | None = None
        self._local_stop: tuple[str, int] | None = None  # (reason, step) not yet agreed across ranks
        self._pending_error: BaseException | None = None
        self._closed = False
        self.steps_recorded = 0  #: rows captured in the current (or last) run

    # ------------------------------------------------------------------ life cycle

    @contextlib.contextmanager
    def run(
        self, name: str | None = None, *, config: Mapping[str, Any] | None = None, resume: str | None = None
    ) -> Iterator[RunInfo]:
        """Context of one training run. Leaving it, however it is left, stores every captured step.

        Args:
            name: a label for the run (several runs may share one).
            config: JSON-serialisable settings stored with the run.
            resume: id of an earlier run to continue: the run keeps that id and its step count
                continues after the last step a sink (SQLite, PostgreSQL) has stored, so a restart
                after a crash neither duplicates nor skips keys.

        Yields:
            the run's :class:`~batchtap.RunInfo`.
        """
        if self._closed:
            raise RunStateError("this Tap is closed; make a new one")
        if self._state is not None:
            raise RunStateError(f"run {self._state.info.name!r} is still active; runs of one Tap cannot nest")
        config = dict(config or {})
        try:
            json.dumps(config)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"run config must be JSON-serialisable: {exc}; convert values to str/float/int") from exc
        started = time.time()
        first_step = 0 if resume is None else self._resume_point(resume)
        info = RunInfo(
            id=resume or uuid.uuid4().hex,
            name=name or time.strftime("run-%Y%m%d-%H%M%S", time.localtime(started)),
            config=config,
            started_at=started,
            world_size=_dist.world_size(),
            environment=_env.environment(),
        )
        self._state = _RunState(info, step=first_step, group=self._group())
        self._stop_reason = None
        self._local_stop = None
        self._pending_error = None
        self._inbox.clear()
        self._applied = 0
        if self._engine is not None:
            self._engine.reset()
        self.steps_recorded = 0
        self._harvester.start_run(dataclasses.replace(info), writes=self._writes(self._state))
        status, reason = RunStatus.FINISHED, None
        terminated = False
        previous_handler = self._catch_sigterm()
        try:
            yield info
        except _Terminated:
            status, reason, terminated = RunStatus.STOPPED, "SIGTERM", True
        except KeyboardInterrupt:
            status, reason = RunStatus.STOPPED, "KeyboardInterrupt"
            raise
        except BaseException as exc:
            status, reason = RunStatus.FAILED, f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if status is RunStatus.FINISHED and self._stop_reason is not None:
                status, reason = RunStatus.STOPPED, self._stop_reason
            try:
                self._finish(status, reason)
            finally:
                if previous_handler is not None:
                    signal.signal(signal.SIGTERM, previous_handler)
        if terminated:
            # Everything is stored: now end the way SIGTERM ends this process without us.
            self.close()
            os.kill(os.getpid(), signal.SIGTERM)

    def _catch_sigterm(self) -> Any:
        """Install the SIGTERM handler for a run; returns the previous one (None when not installed)."""
        if not self.handle_sigterm or threading.current_thread() is not threading.main_thread():
            return None

        def on_sigterm(signum: int, frame: object) -> None:
            raise _Terminated()

        return signal.signal(signal.SIGTERM, on_sigterm)

    def _resume_point(self, run_id: str) -> int:
        """The first step of a resumed run: one after the last step any sink has stored."""
        self._dispatcher.flush()  # sink workers idle: the sinks can be asked directly
        stored = [s for s in (sink.last_step(run_id) for sink in self.sinks) if s is not None]
        if not stored:
            raise ConfigError(
                f"cannot resume run {run_id!r}: no sink has stored a step of it; resume needs a sink "
                "that can tell (bt.sinks.SQLite or bt.sinks.Postgres) holding that run"
            )
        return max(stored) + 1

    def _finish(self, status: RunStatus, reason: str | None) -> None:
        state = self._state
        assert state is not None
        try:
            group = state.group
            if group is not None and group.pending is not None:
                pending, group.pending = group.pending, None
                with contextlib.suppress(Exception):  # a failed exchange was reported at the flush
                    # sync: end of run — complete the last agreement so every rank's groups stay in step
                    pending.wait()
            capture = state.capture
            if capture is not None:
                # in a process group an empty last block still carries late events through the reducer
                self._flush(capture, empty_ok=capture.pipeline.reducer is not None)
                state.info.metrics = capture.layout.names
            state.info.status = status
            state.info.stop_reason = reason
            state.info.ended_at = time.time()
            self._harvester.end_run(dataclasses.replace(state.info), writes=self._writes(state))
            # sync: end of run — every captured step must reach the sinks before run() returns.
            self._harvester.drain()
            self._dispatcher.flush()
        finally:
            self._state = None

    def close(self) -> None:
        """Stop the pipeline and close every sink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._harvester.close()
        self._dispatcher.close()

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop

    def watch(self, loader: Iterable[T], *, epoch: int | None = None) -> Iterator[T]:
        """Iterate ``loader``, numbering batches and timing the wait for each.

        Args:
            loader: any iterable of batches (a ``DataLoader`` usually).
            epoch: the epoch number; default: one more than the last watched epoch.
        """
        state = self._require_run("watch()")
        return self._watch(state, loader, epoch)

    def _watch(self, state: _RunState, loader: Iterable[T], epoch: int | None) -> Iterator[T]:
        state.epoch = epoch if epoch is not None else state.next_epoch
        state.next_epoch = state.epoch + 1
        state.watching = True
        try:
            for index, (batch, data_time, is_last) in enumerate(timed_batches(loader, self.sample_every > 1)):
                if self._runner is not None and self._runner.should_skip(
                    state.epoch, index, step=state.step, run_id=state.info.id
                ):
                    self._send(state, self._runner.take_events())
                    continue  # a rollback asked to skip the batches that led to the divergence
                state.batch = index
                state.data_time = data_time
                state.sampled = index % self.sample_every == 0 or is_last
                if state.sampled:
                    self._arm_start(state)
                yield batch
        finally:
            state.watching = False

    def step(
        self,
        loss: torch.Tensor | None = None,
        *,
        outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        extra: Mapping[str, torch.Tensor | float] | None = None,
        batch_size: int | None = None,
        epoch: int | None = None,
        batch: int | None = None,
    ) -> None:
        """Capture one training step. Launches device ops only; never reads a device value.

        Args:
            loss: the 0-dim loss tensor of the step.
            outputs: model outputs (class scores for accuracy).
            targets: targets (class indices for accuracy).
            extra: further values to record: 0-dim tensors or Python numbers.
            batch_size: samples in the batch (default: ``outputs.shape[0]``).
            epoch: epoch number, when no loader is watched.
            batch: batch index within the epoch, when no loader is watched.

        Raises:
            InputError: an input cannot be measured; nothing of this step is recorded and every
                earlier step stays recorded. Also raised for errors only the values reveal (class
                indices out of range), at the first step after they reached the host.
            RunStateError: called outside :meth:`run`.
        """
        state = self._require_run("step()")
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        if state.watching:
            ep, index, sampled, data_time = state.epoch, state.batch, state.sampled, state.data_time
        else:
            ep, index = state.epoch, state.step
            sampled, data_time = state.step % self.sample_every == 0, math.nan
        if epoch is not None:
            ep = epoch
        if batch is not None:
            index = batch
        if sampled:
            self._capture_step(state, loss, outputs, targets, extra or {}, batch_size, ep, index, data_time)
        state.step += 1
        capture = state.capture
        if capture is None:
            return
        if capture.guard is not None:
            self._poll_guard(capture.guard, state)
        if capture.flusher.due():
            if state.group is not None:
                # Agree before handing the block over: the agreement's collective calls release the
                # GIL, and right after a hand-over the pipeline thread would take it for its decode.
                self._agree(state, state.group)
            self._flush(capture)
        if self._runner is not None and state.group is None:
            self._apply_decisions(state, len(self._inbox))
        if self._runner is not None:
            self._runner.after_step(state.step - 1)
        if not state.watching and state.step % self.sample_every == 0:
            self._arm_start(state)  # last, so the next step's time excludes our own flush

    def _capture_step(
        self,
        state: _RunState,
        loss: torch.Tensor | None,
        outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        extra: Mapping[str, torch.Tensor | float],
        batch_size: int | None,
        epoch: int,
        batch: int,
        data_time: float,
    ) -> None:
        wall = time.time()
        samples = _samples(batch_size, outputs, targets)
        inputs = StepInputs(loss, outputs, targets, samples, extra)
        capture = state.capture
        if capture is None:
            capture = state.capture = self._setup(state, inputs)
        self._check_inputs(capture, inputs)
        # no_grad: metric ops record no graph and the ring write takes tensors that require grad
        with torch.no_grad():
            if capture.autocast_device and torch.is_autocast_enabled(capture.autocast_device):
                # metrics in float32 whatever precision the forward pass ran in
                with torch.autocast(capture.autocast_device, enabled=False):
                    device_values = [v for m in capture.metrics for v in m.compute(inputs)]
            else:
                device_values = [v for m in capture.metrics for v in m.compute(inputs)]
            host_values = [v for m in capture.metrics for v in m.read_host(inputs)]
            if len(device_values) != capture.layout.device_width or len(host_values) != capture.layout.host_width:
                raise ConfigError(_width_mismatch(capture.metrics, inputs))
            flusher = capture.flusher
            row = flusher.rows
            slot = flusher.claim(row)
            capture.ring.write(
                slot,
                device_values,
                host_values,
                step=state.step,
                epoch=epoch,
                batch=batch,
                wall_time=wall,
                samples=samples,
                data_time=data_time,
            )
        capture.clock.mark_end(slot)
        if capture.guard is not None:
            capture.guard.track(slot)
        flusher.rows = row + 1
        self.steps_recorded += 1

    @property
    def should_stop(self) -> bool:
        """True once the NaN guard or a stop rule asked training to stop. Never blocks.

        In a process group it turns True on every rank at the same flush step.
        """
        state = self._state
        if self._local_stop is None and state is not None and state.capture and state.capture.guard:
            self._poll_guard(state.capture.guard, state)
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """Why :attr:`should_stop` turned True, if it did."""
        return self._stop_reason

    @property
    def anomaly_counts(self) -> dict[str, int]:
        """Anomalies per value name in the current (or last) run, as far as the host has seen."""
        decoder = self._last_decoder
        return dict(decoder.anomaly_counts) if decoder is not None else {}

    @property
    def run_info(self) -> RunInfo | None:
        """The active run, if any."""
        return self._state.info if self._state is not None else None

    def flush(self) -> None:
        """Hand every captured step to the sinks and wait until they stored it.

        This waits for the device to finish the captured steps: use it at points where a sync is
        acceptable (end of epoch, before evaluation), not every step.
        """
        state = self._state
        if state is not None and state.capture is not None:
            self._flush(state.capture)
        # sync: explicit flush — the caller asked for every captured step on the host.
        self._harvester.drain()
        self._dispatcher.flush()

    # ------------------------------------------------------------------ internals

    def _require_run(self, what: str) -> _RunState:
        if self._state is None:
            raise RunStateError(
                f"{what} was called outside a run; wrap the training loop in `with tap.run(name=...):`"
            )
        return self._state

    def _setup(self, state: _RunState, inputs: StepInputs) -> _Capture:
        device = _device_of(inputs)
        given = {k for k in ("loss", "outputs", "targets") if getattr(inputs, k) is not None}
        if self._auto_metrics:
            metrics = [m for m in self._metrics if m.requires <= given]
        else:
            metrics = list(self._metrics)
        extras = dict(self._declared_extras)
        for name, value in inputs.extra.items():
            extras.setdefault(name, isinstance(value, torch.Tensor))
        taken = {o.name for m in metrics for o in m.outputs()}
        for name in extras:
            _check_extra_name(name, taken)
        metrics += [Extra(name, on_device=on_device) for name, on_device in extras.items()]
        layout = Layout(metrics)
        ring = MetricRing(
            capacity=self.capacity,
            device_width=layout.device_width,
            host_width=layout.host_width,
            device=device,
            guard_column=layout.guard_column if self.nan_guard else None,
        )
        clock = clock_for(device, self.capacity)
        group = state.group
        flusher = Flusher(
            ring, clock, flush_every=self.flush_every, flush_seconds=None if group else self.flush_seconds
        )
        guard = LossGuard(ring, clock) if ring.guard_column is not None else None
        decoder = Decoder(layout, run_id=state.info.id, rank=group.rank if group else 0)
        reducer = None
        if group is not None:
            outputs = [o for span in layout.spans for o in span.outputs]
            reducer = Reducer(
                outputs, group=group.reduce, rank=group.rank, world_size=group.world_size,
                per_rank_rows=self.per_rank_rows,
            )
        pipeline = RunPipeline(decoder, reducer, writes=self._writes(state))
        self._last_decoder = decoder
        state.info.metrics = layout.names
        state.info.environment["device"] = str(device)  # known from the first step; stored with the run's end
        autocast_device = device.type if device.type in ("cuda", "cpu", "xpu", "mps") else ""
        return _Capture(device, metrics, layout, ring, clock, flusher, guard, pipeline, autocast_device)

    def _check_inputs(self, capture: _Capture, inputs: StepInputs) -> None:
        # Checks read metadata only, so inputs shaped like the last valid step's pass unchecked:
        # the signature costs a few attribute reads, the checks a few dozen microseconds.
        signature = _signature(inputs)
        if signature == capture.checked:
            return
        self._check_inputs_fully(capture, inputs)
        capture.checked = signature

    def _check_inputs_fully(self, capture: _Capture, inputs: StepInputs) -> None:
        given = {k for k in ("loss", "outputs", "targets") if getattr(inputs, k) is not None}
        for metric in capture.metrics:
            missing = metric.requires - given
            if missing:
                raise InputError(
                    f"{type(metric).__name__} needs {', '.join(sorted(missing))}, but step() got none; "
                    f"pass {', '.join(f'{k}=...' for k in sorted(missing))} or remove the metric"
                )
        known = {m.name for m in capture.metrics if isinstance(m, Extra)}
        for name in inputs.extra:
            if name not in known:
                raise InputError(
                    f"extra {name!r} was not present at the run's first step, which fixes the columns; "
                    f"declare it up front with Tap(extras={{{name!r}: 'tensor'}})"
                    + (" — it also clashes with a built-in name" if name in RESERVED_NAMES else "")
                )
        for label, tensor in _tensors(inputs):
            if tensor.device != capture.device:
                raise InputError(
                    f"{label} is on {tensor.device} but this run captures on {capture.device}; move it, "
                    f"e.g. {label}.to({str(capture.device)!r})"
                )
        for metric in capture.metrics:
            metric.check(inputs)

    def _arm_start(self, state: _RunState) -> None:
        capture = state.capture
        if capture is None:
            return  # the ring is made at the first step; that step has no measured start
        slot = capture.flusher.claim(capture.flusher.rows)
        capture.clock.mark_start(slot)

    def _flush(self, capture: _Capture, *, empty_ok: bool = False) -> None:
        block = capture.flusher.flush(empty_ok=empty_ok)
        if block is not None:
            self._harvester.submit(capture.flusher, block, capture.pipeline)

    def _poll_guard(self, guard: LossGuard, state: _RunState) -> None:
        hit = guard.poll()
        if hit is None or not self.nan_guard or self._local_stop is not None:
            return
        step, value = hit
        if self._loss_rule:
            if state.group is None and state.capture is not None:
                # The rules own this decision: hand them the row now and let them decide before
                # the next step (in a process group they decide at the next flush step instead).
                self._flush(state.capture)
                # sync: rare path — a non-finite loss was seen; wait for the rules' verdict on it.
                self._harvester.drain()
                self._apply_decisions(state, len(self._inbox))
            return
        self.request_stop(f"non-finite loss {value!r} at step {step}", step=step, metric="loss")

    def request_stop(self, reason: str, *, step: int | None = None, metric: str | None = None) -> None:
        """Ask training to stop: :attr:`should_stop` turns True (at the next flush step on every
        rank, in a process group) and the run ends as ``stopped`` with ``reason``.

        Thread-safe; the NaN guard and stop rules call it.
        """
        if self._local_stop is not None:
            return
        state = self._state
        step = step if step is not None else (state.step - 1 if state else 0)
        self._local_stop = (reason, step)
        if state is None:
            return
        rank = state.group.rank if state.group else 0
        event = Event(state.info.id, step, EventKind.ACTION, f"stop: {reason}", time.time(), metric=metric, rank=rank)
        self._harvester.events([event], state.capture.pipeline if state.capture else None)
        if state.group is None:
            self._stop_reason = reason  # one process: nobody to agree with

    def _agree(self, state: _RunState, group: _Group) -> None:
        """Agree with every rank, at flush steps, whether to stop and which rule decisions to apply.

        Each flush completes the exchange issued at the previous flush and issues the next one with
        ``async_op=True``. The previous one has had a whole flush interval to finish, so completing it
        normally returns at once: the training thread does not wait for the slowest rank. Every
        rank acts on the same agreed values at the same flush step, one flush after they were sent.
        """
        if group.pending is not None:
            try:
                # sync: completes the CPU collective issued one flush ago (normally already done)
                group.pending.wait()
            except Exception as exc:
                group.pending = None
                self._collective_failed(state, group, exc)
            group.pending = None
            self._act_on_agreement(state, group, group.agree_np[group.turn])
        group.turn ^= 1
        buf = group.agree_np[group.turn]
        buf[0] = 1.0 if self._local_stop else 0.0
        buf[1] = -(group.rank if self._local_stop else group.world_size)  # MAX of -rank = lowest rank
        buf[2] = -self._received_total()  # MAX of -count = the rule messages every rank has
        try:
            group.pending = dist.all_reduce(
                group.agree[group.turn], op=dist.ReduceOp.MAX, group=group.agreement, async_op=True
            )
        except Exception as exc:
            self._collective_failed(state, group, exc)

    def _act_on_agreement(self, state: _RunState, group: _Group, buf: Any) -> None:
        if buf[0] > 0 and self._stop_reason is None:
            stopper = int(-buf[1])
            if self._local_stop is not None and stopper == group.rank:
                self._stop_reason = self._local_stop[0]
            else:
                self._stop_reason = f"rank {stopper} asked every rank to stop"
        if self._runner is not None:
            # every rank applies the same rule decisions at the same step
            self._apply_decisions(state, int(-buf[2]) - self._applied)

    def _collective_failed(self, state: _RunState, group: _Group, exc: Exception) -> None:
        capture = state.capture
        if capture is not None and capture.pipeline.reducer is not None:
            capture.pipeline.reducer.broken = "the agreement exchange failed"
        raise DistributedError(
            f"rank {group.rank}: ranks could not agree at step {state.step - 1} within "
            f"{self.collective_timeout:g} s ({type(exc).__name__}: {exc}); a rank probably died or "
            "stalled. Every step captured so far is being stored."
        ) from exc

    def _received_total(self) -> int:
        return self._applied + len(self._inbox)

    def _apply_decisions(self, state: _RunState, count: int) -> None:
        """Apply the next ``count`` rule messages (training thread)."""
        runner = self._runner
        assert runner is not None
        try:
            for _ in range(count):
                decisions, cleared = self._inbox.popleft()
                self._applied += 1
                runner.apply(decisions, step=state.step - 1, cleared_through=cleared)
        finally:
            self._send(state, runner.take_events())
        if runner.stop_requested and self._local_stop is None:
            reason = runner.stop_reason or "a rule asked to stop"
            self.request_stop(reason)
            # every rank applied the same decisions at this same step: the stop is already agreed
            self._stop_reason = self._stop_reason or reason

    def _send(self, state: _RunState, events: list[Event]) -> None:
        if events:
            self._harvester.events(events, state.capture.pipeline if state.capture else None)

    def _group(self) -> _Group | None:
        if not _dist.is_distributed():
            return None
        if self._groups is None:
            # collective calls: every rank makes them at its first run, in the same order
            self._groups = (new_group(self.collective_timeout), new_group(self.collective_timeout))
        agree = torch.zeros((2, 3), dtype=torch.float64)  # two buffers: one in flight, one being read
        return _Group(_dist.rank(), _dist.world_size(), *self._groups, agree, agree.numpy())

    def _writes(self, state: _RunState) -> bool:
        return state.group is None or state.group.rank == 0

    def _on_block(self, decoded: Decoded) -> None:
        # pipeline thread: surface value-revealed input errors on the training thread
        if decoded.input_errors and self._pending_error is None:
            self._pending_error = InputError(decoded.input_errors[0])
        engine = self._engine
        if engine is None:
            return
        records = decoded.records
        if any(r.rank == ALL_RANKS for r in records):
            records = [r for r in records if r.rank == ALL_RANKS]  # rules judge the reduced rows
        before = engine.cleared_through
        decisions = engine.process(records)
        decoded.events.extend(engine.take_events())
        if decisions or engine.cleared_through != before:
            self._inbox.append((decisions, engine.cleared_through))

    def _on_pipeline_error(self, exc: BaseException) -> None:
        if self._pending_error is None:
            self._pending_error = RuntimeError(f"batchtap pipeline failed: {exc!r}")


# ---------------------------------------------------------------------- helpers


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_metrics(metrics: Sequence[Metric]) -> None:
    seen: set[str] = set()
    for metric in metrics:
        if not isinstance(metric, Metric):
            raise ConfigError(f"metrics must be batchtap.metrics.Metric objects, got {type(metric).__name__}")
        for output in metric.outputs():
            if output.name in seen or output.name in RESERVED_NAMES:
                raise ConfigError(
                    f"metric value name {output.name!r} is used twice or reserved; give the metric another name"
                )
            seen.add(output.name)


def _declared_extras(
    extras: Mapping[str, Literal["tensor", "number"]] | Sequence[str], metrics: Sequence[Metric]
) -> dict[str, bool]:
    kinds = dict(extras) if isinstance(extras, Mapping) else {name: "tensor" for name in extras}
    taken = {o.name for m in metrics for o in m.outputs()}
    out: dict[str, bool] = {}
    for name, kind in kinds.items():
        if kind not in ("tensor", "number"):
            raise ConfigError(f"extras kind for {name!r} must be 'tensor' or 'number', got {kind!r}")
        try:
            _check_extra_name(name, taken)
        except InputError as exc:
            raise ConfigError(str(exc)) from None
        out[name] = kind == "tensor"
    return out


def _check_extra_name(name: object, taken: set[str]) -> None:
    if not isinstance(name, str) or not name:
        raise InputError(f"extra names must be non-empty strings, got {name!r}")
    if name in taken or name in RESERVED_NAMES:
        raise InputError(
            f"extra {name!r} clashes with a built-in metric or record field of the same name; rename it, "
            f"e.g. 'extra_{name}'"
        )


def _width_mismatch(metrics: Sequence[Metric], inputs: StepInputs) -> str:
    for metric in metrics:
        with torch.no_grad():
            device, host = len(metric.compute(inputs)), len(metric.read_host(inputs))
        if (device, host) != (metric.device_width, metric.host_width):
            return (
                f"{type(metric).__name__} declares device_width={metric.device_width}, "
                f"host_width={metric.host_width} but returned {device} device and {host} host values; "
                "make the declared widths match what compute() and read_host() return"
            )
    return "metrics returned a different number of values than they declare"


def _describe(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    return type(value)


def _signature(inputs: StepInputs) -> tuple[Any, ...]:
    """What the input checks depend on: types, shapes, dtypes and devices (never values)."""
    return (
        _describe(inputs.loss),
        _describe(inputs.outputs),
        _describe(inputs.targets),
        tuple((k, _describe(v)) for k, v in inputs.extra.items()),
    )


def _samples(batch_size: int | None, outputs: object, targets: object) -> float:
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
        return float(batch_size)
    for t in (outputs, targets):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return float(t.shape[0])
    return math.nan


def _tensors(inputs: StepInputs) -> list[tuple[str, torch.Tensor]]:
    out = [(k, getattr(inputs, k)) for k in ("loss", "outputs", "targets")]
    out += [(f"extra[{k!r}]", v) for k, v in inputs.extra.items()]
    return [(k, v) for k, v in out if isinstance(v, torch.Tensor)]


def _device_of(inputs: StepInputs) -> torch.device:
    tensors = _tensors(inputs)
    if tensors:
        return tensors[0][1].device
    return torch.device("cpu")
