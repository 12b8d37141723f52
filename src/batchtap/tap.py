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

import atexit
import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
import uuid
import weakref
from pathlib import Path
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from batchtap import _env
from batchtap._names import check_storable
from batchtap._owner import ThreadOwner
from batchtap._ending import wait_for_sinks
from batchtap._config import to_json_config
from batchtap._defaults import store_url
from batchtap.capture.accumulate import MicroBatches
from batchtap.capture.clock import StepClock, clock_for
from batchtap.capture.flush import Flusher
from batchtap.capture.guard import LossGuard
from batchtap.capture.loader import timed_batches
from batchtap.capture.logged import Logged
from batchtap.capture.ring import MetricRing
from batchtap.capture.streams import StreamCheck, stream_check_for
from batchtap.errors import ConfigError, DistributedError, InputError, RunStateError
from batchtap.metrics.base import Metric, StepInputs
from batchtap.metrics.builtin import Extra, GradNorm, default_metrics
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
log = logging.getLogger("batchtap")

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
    micro: MicroBatches  # device sums of the open optimizer step's micro-batches (accumulate())
    device_metrics: list[Metric]  # every metric in device-column order (a plain step)
    step_metrics: list[Metric]  # metrics computed once per optimizer step, in device-column order
    host_spans: list[tuple[Metric, bool]]  # every metric in host-column order, and whether per micro-batch
    checked: tuple[Any, ...] | None = None  # signature of the last inputs that passed the checks
    checked_micro: tuple[Any, ...] | None = None  # ... of the last accumulate() inputs
    # (loss, outputs, targets, grad_norm) metadata of the last plain step that passed the checks:
    # a step whose inputs fit it takes the short path (see Tap._step_fast); None: no short path
    fast_key: tuple[Any, Any, Any, Any] | None = None
    flush_hooks: list[Metric] = dataclasses.field(default_factory=list)  # metrics with an on_flush()
    cuda: bool = False  # the capture device is a CUDA device (steps check for a graph capture)
    streams: StreamCheck | None = None  # CUDA: the run's stream, checked at every step
    host_readers: list[Metric] = dataclasses.field(default_factory=list)  # metrics with host columns, in order
    # log() values waiting for the next flush: (values, run id, rank, whether this rank writes)
    pending_logged: list[tuple[Logged, str, int, bool]] = dataclasses.field(default_factory=list)

    @property
    def step_metrics_all(self) -> list[Metric]:
        """The metrics an accumulated step's ``step()`` call feeds (device or host columns)."""
        return [m for m in self.metrics if not m.per_micro_batch]


#: torch's own grad-mode switch (what ``torch.no_grad`` calls), falling back to the public one
_set_grad_enabled: Callable[[bool], object] = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)


def _eager(method: T) -> T:
    """Exclude ``method`` from torch.compile tracing (``torch.compiler.disable``)."""
    return torch.compiler.disable(method)  # type: ignore[arg-type,return-value]


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
    micro: MicroBatches | None = None  # accumulate() before the run's first step() made the capture
    sigterm_handler: Any = None  # the SIGTERM handler run() replaced, restored at its end
    owner: ThreadOwner = dataclasses.field(default_factory=ThreadOwner)  # the one thread that steps


class Tap:
    """Captures per-batch metrics on the device and streams them to sinks.

    Args:
        metrics: what to measure. Default: :func:`batchtap.metrics.default_metrics` (loss, top-1
            accuracy, timings, throughput, memory, plus lr and grad norm when ``optimizer`` /
            ``model`` are given); default metrics whose inputs a step lacks are dropped.
        sinks: where records go. Default: the SQLite store ``$BATCHTAP_DB`` (else
            ``runs/batchtap.db``; a ``postgresql://`` URL there means PostgreSQL) plus a
            :class:`~batchtap.sinks.Console`, so ``batchtap runs`` shows the run. ``[]`` for none.
        flush_every: copy captured rows to the host after this many recorded steps.
        flush_seconds: ... or when the oldest unflushed row is this many seconds old.
        sample_every: record every N-th batch (and always the last batch of a watched epoch).
        capacity: ring slots; default ``4 * flush_every``, at least ``2 * flush_every``.
        nan_guard: watch the loss every step through the fast channel; a non-finite loss sets
            :attr:`should_stop` within the device's lag (at the same step on the CPU).
        extras: names of values passed later as ``step(extra=...)``, mapped to ``"tensor"`` or
            ``"number"`` (a plain sequence means tensors). Extras seen at the first step are added
            automatically.
        optimizer: adds :class:`~batchtap.metrics.LearningRate` to the default metrics; a mapping
            ``{"g": opt_g, "d": opt_d}`` adds one per optimizer (``lr_g``, ``lr_d``).
        model: adds :class:`~batchtap.metrics.GradNorm` to the default metrics (a mapping: one
            per model, ``grad_norm_g``...).
        scaler: an AMP ``GradScaler``: adds :class:`~batchtap.metrics.LossScale` (the loss scale,
            and each step the scaler skipped, as a ``skip`` event instead of anomalies) and makes
            the gradient norm unscaled.
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
        exit_timeout: at interpreter exit, a run still open (``start()`` without ``finish()``)
            is ended as ``failed``; its captured steps are stored if the sinks take them within
            this many seconds, and the process exits either way.
        end_timeout: leaving ``run()`` (or ``finish()``, ``close()``) waits at most this many
            seconds for the sinks; a sink still busy then (a server that stopped answering) is
            reported with exactly what it had not stored (log warning, and an event to the other
            sinks), and the call returns. With ``spool_dir`` a hung sink's blocks are spooled
            within its ``call_timeout`` (10 s) instead.

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
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None = None,
        model: torch.nn.Module | Mapping[str, torch.nn.Module] | None = None,
        scaler: Any = None,
        queue_size: int = 64,
        backpressure: Backpressure = "block",
        rules: Sequence[RuleLike] = (),
        rollback: Rollback | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        handle_sigterm: bool = True,
        per_rank_rows: bool = False,
        collective_timeout: float = 300.0,
        exit_timeout: float = 10.0,
        end_timeout: float = 60.0,
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
        self._metrics = list(default_metrics(optimizer, model, scaler=scaler) if metrics is None else metrics)
        _check_metrics(self._metrics)
        self._declared_extras = _declared_extras(extras, self._metrics)
        if sinks is None:
            sinks = _default_sinks()
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
        self.exit_timeout = float(exit_timeout)
        if not (isinstance(end_timeout, (int, float)) and 0 < end_timeout < math.inf):
            raise ConfigError(f"end_timeout must be a finite number of seconds > 0, got {end_timeout!r}")
        self.end_timeout = float(end_timeout)
        self.steps_recorded = 0  #: rows captured in the current (or last) run
        _OPEN_AT_EXIT.add(self)  # weak: a run left open at interpreter exit is ended, never hangs

    # ------------------------------------------------------------------ life cycle

    @contextlib.contextmanager
    def run(
        self, name: str | None = None, *, config: Any = None, resume: str | None = None
    ) -> Iterator[RunInfo]:
        """Context of one training run. Leaving it, however it is left, stores every captured step.

        Args:
            name: a label for the run (several runs may share one). Resuming without a name keeps
                the stored run's name.
            config: settings stored with the run: a mapping, an ``argparse.Namespace`` or a
                dataclass; paths, enums, dtypes and devices are stored as text, anything else that
                JSON cannot hold as its ``repr`` (with a warning).
            resume: id of an earlier run to continue: the run keeps that id and its step count
                continues after the last step a sink (SQLite, PostgreSQL) has stored, so a restart
                after a crash neither duplicates nor skips keys.

        Yields:
            the run's :class:`~batchtap.RunInfo`.
        """
        info = self.start(name, config=config, resume=resume)
        status, reason = RunStatus.FINISHED, None
        terminated = False
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
            if self._state is not None and self._state.info is info:  # not ended at interpreter exit
                self.finish(status, reason=reason)
        if terminated:
            # Everything is stored: now end the way SIGTERM ends this process without us.
            self.close()
            os.kill(os.getpid(), signal.SIGTERM)

    def start(self, name: str | None = None, *, config: Any = None, resume: str | None = None) -> RunInfo:
        """Begin a run without a ``with`` block (a script-level loop, a notebook); end it with
        :meth:`finish`. Arguments as for :meth:`run`.

        A run still open at interpreter exit is ended as ``failed`` (bounded by ``exit_timeout``).

        Example:
            >>> import torch, batchtap as bt
            >>> tap = bt.Tap(sinks=[])
            >>> info = tap.start(name="script")
            >>> tap.step(loss=torch.tensor(0.5))
            >>> tap.finish()
            >>> tap.close()
        """
        if self._closed:
            raise RunStateError("this Tap is closed; make a new one")
        if self._state is not None:
            raise RunStateError(f"run {self._state.info.name!r} is still active; runs of one Tap cannot nest")
        for label, text in (("run name", name), ("resume id", resume)):
            if text is not None:
                if not isinstance(text, str):
                    raise InputError(f"{label} must be a string or None, got {type(text).__name__}")
                check_storable(label, text)
        try:
            config_json, as_repr = to_json_config(config)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
        config_json = _env.scrub_secrets(config_json)  # passwords and tokens are never stored
        started = time.time()
        stored_name = None
        first_step = 0
        if resume is not None:
            first_step, stored_name = self._resume_point(resume)
        info = RunInfo(
            id=resume or uuid.uuid4().hex,
            name=name or stored_name or time.strftime("run-%Y%m%d-%H%M%S", time.localtime(started)),
            config=config_json,
            started_at=started,
            world_size=_dist.world_size(),
            environment=_env.environment(),
        )
        self._state = _RunState(info, step=first_step, group=self._group())
        if self._state.group is not None and resume is None:
            # every rank's rows and events belong to the one run: rank 0's id
            info.id = _dist.shared_run_id(info.id, self._state.group.agreement)
        self._stop_reason = None
        self._local_stop = None
        self._pending_error = None
        self._inbox.clear()
        self._applied = 0
        if self._engine is not None:
            self._engine.reset()
        self.steps_recorded = 0
        self._harvester.start_run(dataclasses.replace(info), writes=self._writes(self._state))
        # sync: run start — the run's row is stored before training starts, so a run killed before
        # its first flush can still be resumed (bounded; a down sink spools or reports it).
        if self._harvester.drain(self.end_timeout):
            self._dispatcher.flush(timeout=self.end_timeout)
        if as_repr:
            message = (
                f"config values stored as their repr (JSON cannot hold them): {', '.join(as_repr)}; "
                "pass str/int/float/bool/list/dict values to store them as such"
            )
            log.warning("batchtap: %s", message)
            self._send(self._state, [Event(info.id, first_step, EventKind.WARNING, message, started)])
        self._state.sigterm_handler = self._catch_sigterm()
        return info

    def finish(
        self,
        status: RunStatus | Literal["finished", "failed", "stopped"] = RunStatus.FINISHED,
        *,
        reason: str | None = None,
    ) -> None:
        """End the run begun with :meth:`start`: every captured step is stored before it returns.

        Args:
            status: how the run ended. A run that a stop rule or the NaN guard stopped is stored as
                ``stopped`` with that reason, whatever ``finished`` says.
            reason: why it failed or stopped, stored with the run.
        """
        state = self._require_run("finish()")
        status = RunStatus(status)
        if status is RunStatus.RUNNING:
            raise ConfigError("finish() needs a final status: 'finished', 'failed' or 'stopped'")
        if status is RunStatus.FINISHED and self._stop_reason is not None:
            status, reason = RunStatus.STOPPED, self._stop_reason
        handler, state.sigterm_handler = state.sigterm_handler, None
        try:
            self._finish(status, reason)
        finally:
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)

    def _catch_sigterm(self) -> Any:
        """Install the SIGTERM handler for a run; returns the previous one (None when not installed)."""
        if not self.handle_sigterm or threading.current_thread() is not threading.main_thread():
            return None

        def on_sigterm(signum: int, frame: object) -> None:
            raise _Terminated()

        return signal.signal(signal.SIGTERM, on_sigterm)

    def _resume_point(self, run_id: str) -> tuple[int, str | None]:
        """The first step of a resumed run (one after the last step any sink has stored) and the
        name the run was stored under."""
        self._dispatcher.flush()  # sink workers idle: the sinks can be asked directly
        stored = [s for s in (sink.last_step(run_id) for sink in self.sinks) if s is not None]
        names = [n for n in (sink.run_name(run_id) for sink in self.sinks) if n is not None]
        if not stored and not names:
            raise ConfigError(
                f"cannot resume run {run_id!r}: no sink holds that run; resume needs a sink that can tell "
                "(bt.sinks.SQLite or bt.sinks.Postgres) holding it; fix: check the id (batchtap runs) and the store"
            )
        # a run stored before its first flush (killed early) has no step yet: it resumes at step 0
        return (max(stored) + 1 if stored else 0), (names[0] if names else None)

    def _finish(self, status: RunStatus, reason: str | None, *, timeout: float | None = None) -> None:
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
            # sync: end of run — every captured step reaches the sinks before run() returns, within end_timeout.
            wait_for_sinks(
                self._harvester, self._dispatcher, state.info,
                timeout=self.end_timeout if timeout is None else timeout, last_step=state.step - 1,
            )
        finally:
            self._state = None

    def _end_at_exit(self) -> None:
        """Interpreter exit with a run still open: end it as failed, waiting at most ``exit_timeout``."""
        state = self._state
        if state is None or self._closed:
            return
        state.sigterm_handler = None  # signal handlers no longer matter at exit
        try:
            self._finish(
                RunStatus.FAILED,
                "the process exited with the run still open (finish() was never called)",
                timeout=self.exit_timeout,
            )
        except Exception:  # never turn interpreter exit into a traceback of ours
            log.exception("batchtap: ending the open run at exit failed")

    def close(self) -> None:
        """Stop the pipeline and close every sink. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._harvester.close()
        self._dispatcher.close(timeout=self.end_timeout)

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
            total: int | None = len(loader)  # type: ignore[arg-type]
        except TypeError:
            total = None  # an iterable without a length: progress shows a count, no percentage
        # Through the pipeline queue (no I/O here): progress displays learn the epoch's length.
        self._harvester.start_epoch(state.info.id, state.epoch, total, writes=self._writes(state))
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
                micro = state.capture.micro if state.capture is not None else state.micro
                if state.sampled and (micro is None or micro.count == 0):
                    self._arm_start(state)  # an optimizer step starts with its first micro-batch
                yield batch
        finally:
            state.watching = False

    # Runs eagerly inside a torch.compile'd function too: traced, dynamo would guard on the step
    # counter and recompile every step (host arrays and events cannot be traced anyway).
    @_eager
    def step(
        self,
        loss: torch.Tensor | None = None,
        *,
        outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        extra: Mapping[str, torch.Tensor | float] | None = None,
        batch_size: int | None = None,
        tokens: int | None = None,
        grad_norm: torch.Tensor | float | None = None,
        epoch: int | None = None,
        batch: int | None = None,
    ) -> None:
        """Capture one optimizer step. Launches device ops only; never reads a device value.

        With gradient accumulation, pass each micro-batch to :meth:`accumulate` and call
        ``step()`` once per optimizer step without ``loss``/``outputs``/``targets``.

        Args:
            loss: the 0-dim loss tensor of the step (the unscaled loss, not ``loss / accum``).
            outputs: model outputs (class scores for accuracy: ``[N, C]``, ``[N, C, d...]`` or
                ``[B, T, V]`` sequence logits).
            targets: targets (class indices for accuracy; ``-100`` entries are ignored).
            extra: further values to record: 0-dim tensors or Python numbers.
            batch_size: samples in the batch (default: ``outputs.shape[0]``).
            tokens: tokens in the batch; throughput then counts tokens per second.
            grad_norm: the gradient norm the loop computed, e.g. what ``clip_grad_norm_``
                returned (the norm before clipping): recorded as ``grad_norm``.
            epoch: epoch number, when no loader is watched.
            batch: batch index within the epoch, when no loader is watched.

        Raises:
            InputError: an input cannot be measured; nothing of this step is recorded and every
                earlier step stays recorded. Also raised for errors only the values reveal (class
                indices out of range), at the first step after they reached the host.
            RunStateError: called outside :meth:`run`.
        """
        state = self._state
        if (
            state is not None
            and extra is None
            and epoch is None
            and batch is None
            and self._pending_error is None
            and state.capture is not None
            and self._step_fast(state, state.capture, loss, outputs, targets, batch_size, tokens, grad_norm)
        ):
            return
        state = self._require_run("step()")
        state.owner.check("step()")
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        micro = state.capture.micro if state.capture is not None else state.micro
        accumulated = micro is not None and micro.count > 0
        if accumulated and (loss is not None or outputs is not None or targets is not None):
            raise InputError(
                "step() got loss/outputs/targets after accumulate() calls in the same optimizer step; pass "
                "every micro-batch (the last one too) to accumulate() and call step() without them"
            )
        if state.watching:
            ep, index, sampled, data_time = state.epoch, state.batch, state.sampled, state.data_time
        else:
            ep, index = state.epoch, state.step
            sampled, data_time = state.step % self.sample_every == 0, math.nan
        if epoch is not None:
            ep = epoch
        if batch is not None:
            index = batch
        if accumulated:
            assert micro is not None
            sampled, data_time = True, micro.data_time  # accumulate() only sums sampled steps
        if sampled:
            try:
                self._capture_step(
                    state, loss, outputs, targets, extra or {}, batch_size, tokens, grad_norm, ep, index, data_time, micro
                )
            except OverflowError:  # nothing was recorded yet: a number too large for a float
                raise InputError(_overflow_message(extra or {}, tokens)) from None
        if micro is not None:
            micro.reset()
        state.step += 1
        if state.capture is not None:
            self._after_step(state, state.capture)

    def _after_step(self, state: _RunState, capture: _Capture) -> None:
        """What follows every step, captured or not: NaN guard, flush, rule decisions, next start mark."""
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

    # Runs eagerly inside a torch.compile'd function too: traced, dynamo would guard on the step
    # counter and recompile every step (host arrays and events cannot be traced anyway).
    @_eager
    def accumulate(
        self,
        loss: torch.Tensor | None = None,
        *,
        outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        batch_size: int | None = None,
        tokens: int | None = None,
    ) -> None:
        """Add one micro-batch to the optimizer step that the next :meth:`step` call closes.

        Sums stay on the device (no host read). The step's record then holds the sample-weighted
        mean of the micro-batch losses, accuracy over every counted target of every micro-batch,
        ``step_time`` from the first micro-batch's start to ``step()``, throughput over all of the
        step's samples (or ``tokens``), and the summed loader wait.

        Pass the *unscaled* loss: nanoGPT-style loops divide it by the number of micro-batches
        for ``backward()``; give batchtap the loss before that division.

        Example:
            >>> import torch, batchtap as bt
            >>> tap = bt.Tap(sinks=[])
            >>> with tap, tap.run():
            ...     for micro_loss in (torch.tensor(1.0), torch.tensor(3.0)):
            ...         tap.accumulate(loss=micro_loss, batch_size=8)
            ...     tap.step()
            >>> tap.steps_recorded
            1
        """
        state = self._require_run("accumulate()")
        state.owner.check("accumulate()")
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        _check_device_context(state.capture, loss, outputs)
        if state.step % self.sample_every != 0:
            return  # this optimizer step is not sampled
        samples = _samples(batch_size, outputs, targets)
        if tokens is not None:
            _check_count("tokens", tokens)
        inputs = StepInputs(loss, outputs, targets, samples, {})
        capture = state.capture
        micro = capture.micro if capture is not None else state.micro
        if micro is None:
            device = _device_of(inputs)
            inputs = dataclasses.replace(inputs, device=device)
            state.micro = micro = MicroBatches(self._select_metrics(inputs, micro=True), device)
        else:
            inputs = dataclasses.replace(inputs, device=micro.device)
        signature = _signature(inputs)
        if capture is None or signature != capture.checked_micro:
            self._check_inputs_fully(inputs, micro.metrics, micro.device, "accumulate()")
            if not micro.metrics and loss is None:
                raise InputError("accumulate() got nothing to measure; pass the micro-batch's loss (and outputs/targets)")
            if capture is not None:
                capture.checked_micro = signature
        if state.watching:
            micro.add_data_time(state.data_time)
        with torch.no_grad():
            values = self._compute(micro.metrics, inputs, _autocast_device(micro.device))
            for metric in micro.metrics:
                if metric.host_width:
                    micro.host[id(metric)] = metric.read_host(inputs)
            micro.add(values, samples=samples, tokens=tokens)

    @_eager
    def log(self, values: Mapping[str, torch.Tensor | float], *, step: int | None = None) -> None:
        """Record values that are not per training step: evaluation, epoch summaries, anything.

        Any name, first seen at any step; stored in the same store as their own rows (not as
        columns of every step), shown by ``batchtap show/plot/export`` and sent to TensorBoard.
        Tensors are copied to the host asynchronously: no host read here either. The values reach
        the sinks with the next flush (after the rows of the steps before them), as step values do;
        ``flush()`` or the end of the run hands them over at once.

        In a process group every rank may call it; rank 0's values are stored (reduce evaluation
        values over ranks yourself, e.g. with ``all_reduce``, before logging them).

        Args:
            values: name -> Python number or 0-dim tensor.
            step: the training step the values belong to (default: the last captured step).

        Example:
            >>> import torch, batchtap as bt
            >>> tap = bt.Tap(sinks=[])
            >>> with tap, tap.run():
            ...     tap.step(loss=torch.tensor(0.7))
            ...     tap.log({"val_loss": 0.31, "val_acc": torch.tensor(0.9)})
        """
        state = self._require_run("log()")
        state.owner.check("log()")
        if not isinstance(values, Mapping) or not values:
            raise InputError(f"log() takes a non-empty mapping of name -> number or 0-dim tensor, got {values!r}")
        if step is not None:
            _check_count("step", step, minimum=0)
        taken = set(state.capture.layout.names) if state.capture is not None else set()
        for name, value in values.items():
            if not isinstance(name, str) or not name:
                raise InputError(f"log() names must be non-empty strings, got {name!r}")
            check_storable("log() name", name)
            if name in taken or name in RESERVED_NAMES:
                raise InputError(
                    f"log() name {name!r} is already a per-step value or record field of this run; log it "
                    f"under another name, e.g. 'eval_{name}'"
                )
            _check_scalar(f"log() value {name!r}", value)
        if step is None:
            step = max(state.step - 1, 0)
        capture = state.capture
        clock = capture.clock if capture is not None else None
        logged = Logged.capture(
            values, step=step, epoch=state.epoch, wall_time=time.time(), marker=lambda: _done_check(clock, values)
        )
        rank = state.group.rank if state.group else 0
        item = (logged, state.info.id, rank, self._writes(state))
        if capture is not None and state.group is None:
            # Handed over with the next flush, after the block of the steps before it: no flush of
            # its own (a Lightning module logging on every step would otherwise flush every step).
            capture.pending_logged.append(item)
        else:  # before the first step, or in a process group (which flushes at agreed steps only)
            self._harvester.logged(logged, run_id=item[1], rank=rank, writes=item[3])

    def _capture_step(
        self,
        state: _RunState,
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
        wall = time.time()
        _check_device_context(state.capture, loss, outputs)
        accumulated = micro is not None and micro.count > 0
        if tokens is not None:
            _check_count("tokens", tokens)
        if grad_norm is not None:
            _check_scalar("grad_norm", grad_norm)
        if accumulated:
            assert micro is not None
            samples = micro.samples if batch_size is None else _samples(batch_size, None, None)
            step_tokens = micro.tokens if tokens is None else float(tokens)
        else:
            samples = _samples(batch_size, outputs, targets)
            step_tokens = math.nan if tokens is None else float(tokens)
        capture = state.capture
        if capture is None:
            inputs = StepInputs(loss, outputs, targets, samples, extra, grad_norm)
            capture = state.capture = self._setup(state, inputs, micro if accumulated else None)
        inputs = StepInputs(loss, outputs, targets, samples, extra, grad_norm, device=capture.device)
        self._check_inputs(capture, inputs, accumulated)
        # Grad mode off: metric ops record no graph and the ring write takes tensors that require
        # grad. The bare switch that torch.no_grad itself uses: a context manager costs ~1 us a step.
        grad_was = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            if accumulated:
                assert micro is not None
                head: torch.Tensor | None = micro.result()
                device_values = self._compute(capture.step_metrics, inputs, capture.autocast_device)
                host_values = [
                    v
                    for metric, per_micro in capture.host_spans
                    for v in (micro.host.get(id(metric), ()) if per_micro else metric.read_host(inputs))
                ]
                device_count = capture.micro.width + len(device_values)
            else:
                head = None
                device_values = self._compute(capture.device_metrics, inputs, capture.autocast_device)
                host_values = [v for metric in capture.host_readers for v in metric.read_host(inputs)]
                device_count = len(device_values)
            if device_count != capture.layout.device_width or len(host_values) != capture.layout.host_width:
                raise ConfigError(_width_mismatch(capture.metrics, inputs))
            self._store_row(
                state, capture, device_values, host_values, epoch=epoch, batch=batch, wall_time=wall,
                samples=samples, data_time=data_time, tokens=step_tokens, head=head,
            )
        finally:
            _set_grad_enabled(grad_was)
        capture.fast_key = None
        if not accumulated and not extra and self.sample_every == 1 and state.group is None and self._runner is None:
            capture.fast_key = (_meta(loss), _meta(outputs), _meta(targets), _meta(grad_norm))

    def _step_fast(
        self,
        state: _RunState,
        capture: _Capture,
        loss: torch.Tensor | None,
        outputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        batch_size: int | None,
        tokens: int | None,
        grad_norm: torch.Tensor | float | None,
    ) -> bool:
        """The short path of :meth:`step` for inputs shaped like the last checked plain step's.

        Same effect as the general path, with the steps that cannot apply left out: inputs that fit
        the metadata that already passed every check, no accumulation, no extras, every step
        sampled, no process group, no rule actions (those take the general path). Returns False,
        having done nothing, when the step does not qualify.
        """
        state.owner.check("step()")
        if capture.cuda:
            _check_device_context(capture)
        key = capture.fast_key
        if (
            key is None
            or capture.micro.count
            or not _fits(loss, key[0])
            or not _fits(outputs, key[1])
            or not _fits(targets, key[2])
            or not _fits(grad_norm, key[3])
            or (capture.autocast_device and torch.is_autocast_enabled(capture.autocast_device))
        ):
            return False
        if grad_norm is not None and not isinstance(grad_norm, torch.Tensor):
            _check_scalar("grad_norm", grad_norm)  # a Python number: its value may not fit a float
        samples = _samples(batch_size, outputs, targets)
        step_tokens = math.nan
        if tokens is not None:
            _check_count("tokens", tokens)
            try:
                step_tokens = float(tokens)
            except OverflowError:  # nothing was recorded yet, as in step()
                raise InputError(_overflow_message({}, tokens)) from None
        if state.watching:
            epoch, batch, data_time = state.epoch, state.batch, state.data_time
        else:
            epoch, batch, data_time = state.epoch, state.step, math.nan
        inputs = StepInputs(loss, outputs, targets, samples, {}, grad_norm, device=capture.device)
        wall = time.time()
        grad_was = torch.is_grad_enabled()
        _set_grad_enabled(False)  # as in _capture_step
        try:
            device_values = [v for m in capture.device_metrics for v in m.compute(inputs)]
            host_values = [v for metric in capture.host_readers for v in metric.read_host(inputs)]
            self._store_row(
                state, capture, device_values, host_values, epoch=epoch, batch=batch, wall_time=wall,
                samples=samples, data_time=data_time, tokens=step_tokens,
            )
        finally:
            _set_grad_enabled(grad_was)
        state.step += 1
        self._after_step(state, capture)
        return True

    def _store_row(
        self,
        state: _RunState,
        capture: _Capture,
        device_values: list[torch.Tensor],
        host_values: Sequence[float],
        *,
        epoch: int,
        batch: int,
        wall_time: float,
        samples: float,
        data_time: float,
        tokens: float,
        head: torch.Tensor | None = None,
    ) -> None:
        """Write the step's row into its ring slot, with its end mark and NaN-guard entry (grad mode off)."""
        flusher, guard = capture.flusher, capture.guard
        row = flusher.rows
        slot = flusher.claim(row)
        if guard is not None:
            guard.settle(row)  # before the write overwrites the slot's last loss copy
        capture.ring.write(
            slot, device_values, host_values, step=state.step, epoch=epoch, batch=batch, wall_time=wall_time,
            samples=samples, data_time=data_time, tokens=tokens, head=head,
        )
        capture.clock.mark_end(slot)
        if guard is not None:
            guard.track(slot, row)
        flusher.rows = row + 1
        self.steps_recorded += 1

    def _compute(self, metrics: Sequence[Metric], inputs: StepInputs, autocast_device: str) -> list[torch.Tensor]:
        """Every metric's device values, in float32 whatever precision the forward pass ran in."""
        if autocast_device and torch.is_autocast_enabled(autocast_device):
            with torch.autocast(autocast_device, enabled=False):
                return [v for m in metrics for v in m.compute(inputs)]
        return [v for m in metrics for v in m.compute(inputs)]

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

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Keep batchtap's pipeline thread off the device while the body runs.

        Wrap a CUDA graph capture in it: the pipeline thread polls CUDA events to learn when
        flushed rows arrived, and in ``torch.cuda.graph``'s default ``capture_error_mode="global"``
        a query from another thread during a capture invalidates it (the hazard PyTorch fixed for
        its NCCL watchdog). Queries resume when the body ends; rows flushed meanwhile wait. Do not
        train inside it: ``tap.step()`` cannot be captured anyway (it raises there), and a full
        ring would wait for a pipeline that is paused. ``flush()`` inside it raises.

        Example (on a GPU)::

            g = torch.cuda.CUDAGraph()
            with tap.paused(), torch.cuda.graph(g):
                static_loss = train_step(static_x, static_y)
            for x, y in loader:
                static_x.copy_(x); static_y.copy_(y)
                g.replay()
                tap.step(loss=static_loss)  # outside the capture, on the graph's static outputs
        """
        gate = self._harvester.gate
        gate.pause()
        try:
            yield
        finally:
            gate.resume()

    def flush(self) -> None:
        """Hand every captured step to the sinks and wait until they stored it.

        This waits for the device to finish the captured steps: use it at points where a sync is
        acceptable (end of epoch, before evaluation), not every step.
        """
        if self._harvester.gate.paused:
            raise RunStateError(
                "flush() was called inside tap.paused(): the pipeline cannot read rows while paused; "
                "flush after the paused block"
            )
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

    def _select_metrics(self, inputs: StepInputs, *, micro: bool) -> list[Metric]:
        """The per-micro-batch (``micro``) or per-step metrics of this run; default metrics whose
        inputs the first call lacks (or that do not fit them, e.g. accuracy of float targets) are left out."""
        chosen = [m for m in self._metrics if m.per_micro_batch == micro]
        if self._auto_metrics:
            chosen = [m for m in chosen if m.applies(inputs)]
        return chosen

    def _setup(self, state: _RunState, inputs: StepInputs, micro: MicroBatches | None) -> _Capture:
        device = micro.device if micro is not None else _device_of(inputs)
        inputs = dataclasses.replace(inputs, device=device)
        chosen = {id(m) for m in (micro.metrics if micro is not None else self._select_metrics(inputs, micro=True))}
        chosen |= {id(m) for m in self._select_metrics(inputs, micro=False)}
        metrics = [m for m in self._metrics if id(m) in chosen]
        if inputs.grad_norm is not None and not any(isinstance(m, GradNorm) and m.takes_step_grad_norm for m in metrics):
            metrics.append(GradNorm())  # the loop's own norm (clip_grad_norm_'s return value)
        extras = dict(self._declared_extras)
        for name, value in inputs.extra.items():
            extras.setdefault(name, isinstance(value, torch.Tensor))
        taken = {o.name for m in metrics for o in m.outputs()}
        for name in extras:
            _check_extra_name(name, taken)
        metrics += [Extra(name, on_device=on_device) for name, on_device in extras.items()]
        _check_metrics(metrics)
        layout = Layout(metrics)
        if micro is None:
            micro = MicroBatches([sp.metric for sp in layout.device_order if sp.metric.per_micro_batch], device)
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
        autocast_device = _autocast_device(device)
        state.micro = None  # the capture owns it from here
        return _Capture(
            device, metrics, layout, ring, clock, flusher, guard, pipeline, autocast_device,
            micro=micro,
            device_metrics=[sp.metric for sp in layout.device_order],
            step_metrics=[sp.metric for sp in layout.device_order if not sp.metric.per_micro_batch],
            host_spans=[(m, m.per_micro_batch) for m in metrics],
            flush_hooks=[m for m in metrics if type(m).on_flush is not Metric.on_flush],
            cuda=device.type == "cuda",
            streams=stream_check_for(device),
            host_readers=[m for m in metrics if m.host_width],
        )

    def _check_inputs(self, capture: _Capture, inputs: StepInputs, accumulated: bool) -> None:
        # Checks read metadata only, so inputs shaped like the last valid step's pass unchecked:
        # the signature costs a few attribute reads, the checks a few dozen microseconds.
        signature = (_signature(inputs), accumulated)
        if signature == capture.checked:
            return
        metrics = capture.step_metrics_all if accumulated else capture.metrics
        self._check_inputs_fully(inputs, metrics, capture.device)
        if inputs.grad_norm is not None and not any(isinstance(m, GradNorm) and m.takes_step_grad_norm for m in capture.metrics):
            raise InputError(
                "grad_norm= was not passed at the run's first step, which fixes the columns; pass it from "
                "the first step on, or add bt.metrics.GradNorm() to the Tap's metrics"
            )
        capture.checked = signature

    def _check_inputs_fully(
        self, inputs: StepInputs, metrics: Sequence[Metric], device: torch.device, call: str = "step()"
    ) -> None:
        given = {k for k in ("loss", "outputs", "targets") if getattr(inputs, k) is not None}
        for metric in metrics:
            missing = metric.requires - given
            if missing:
                raise InputError(
                    f"{type(metric).__name__} needs {', '.join(sorted(missing))}, but {call} got none; "
                    f"pass {', '.join(f'{k}=...' for k in sorted(missing))} or remove the metric"
                )
        known = {m.name for m in metrics if isinstance(m, Extra)}
        for name in inputs.extra:
            if name not in known:
                raise InputError(
                    f"extra {name!r} was not present at the run's first step, which fixes the columns; "
                    f"declare it up front with Tap(extras={{{name!r}: 'tensor'}}), or log values that "
                    f"come and go with tap.log({{{name!r}: value}})"
                    + (" — it also clashes with a built-in name" if name in RESERVED_NAMES else "")
                )
        for label, tensor in _tensors(inputs):
            if tensor.device != device:
                raise InputError(
                    f"{label} is on {tensor.device} but this run captures on {device}; move it, "
                    f"e.g. {label}.to({str(device)!r})"
                )
        for metric in metrics:
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
            for metric in capture.flush_hooks:
                metric.on_flush()
        if capture.pending_logged:
            for logged, run_id, rank, writes in capture.pending_logged:
                self._harvester.logged(logged, run_id=run_id, rank=rank, writes=writes)
            capture.pending_logged.clear()

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
            f"rank {group.rank}: ranks could not agree at step {state.step - 1}: "
            f"{_dist.describe_failure(exc, self.collective_timeout)}; a rank probably died or "
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
            try:
                check_storable("metric value name", output.name)
            except InputError as exc:
                raise ConfigError(str(exc)) from None
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
    check_storable("extra name", name)
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
    extra = inputs.extra
    return (
        _describe(inputs.loss),
        _describe(inputs.outputs),
        _describe(inputs.targets),
        tuple((k, _describe(v)) for k, v in extra.items()) if extra else (),
        _describe(inputs.grad_norm),
    )


_GRAPH_CAPTURE = (
    "tap.step()/accumulate() was called while a CUDA graph is being captured on this stream; it writes "
    "host arrays and records events, which a graph cannot hold. Capture the model's step alone, then "
    "call tap.step() on the graph's static outputs after each replay (outside the capture); wrap the "
    "capture in `with tap.paused():` so batchtap's pipeline thread stays off the device meanwhile"
)


def _check_device_context(capture: _Capture | None, *tensors: object) -> None:
    """Refuse a step during a CUDA graph capture or on another stream than the run's (CUDA only;
    before the run's first capture the device is read off ``tensors``)."""
    cuda = capture.cuda if capture is not None else any(
        isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tensors
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


def _meta(value: object) -> object:
    """What the short path of ``step()`` compares an input with: tensor metadata, else the type."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.dtype, value.device)
    return type(value)


def _fits(value: object, meta: object) -> bool:
    """Whether ``value`` has the metadata ``meta`` (from :func:`_meta`): a few attribute reads."""
    if type(meta) is tuple:
        return (
            isinstance(value, torch.Tensor)
            and value.shape == meta[0]
            and value.dtype == meta[1]
            and value.device == meta[2]
        )
    return type(value) is meta


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
    for label, tensor in tensors:
        if tensor.device.type == "meta":
            raise InputError(
                f"{label} is a meta tensor (shape and dtype only, no data); expected a computed tensor; fix: "
                "pass the value computed on a real device (cpu, cuda...)"
            )
    if tensors:
        return tensors[0][1].device
    return torch.device("cpu")


def _overflow_message(extra: Mapping[str, object], tokens: object) -> str:
    named = [(f"extra[{k!r}]", v) for k, v in extra.items()] + [("tokens", tokens)]
    for label, value in named:
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                float(value)
            except OverflowError:
                return (
                    f"{label} = an integer of {value.bit_length()} bits does not fit a float (at most 1024 bits, ~1.8e308); "
                    "expected a number a float can hold; fix: pass a float or a smaller number"
                )
    return "a value does not fit a float (max ~1.8e308); fix: pass floats or smaller numbers"


def _check_count(name: str, value: object, *, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_scalar(label: str, value: object) -> None:
    """A Python number or a real 0-dim tensor (checked from metadata only)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
            raise InputError(
                f"{label} must be a real 0-dim tensor or a number, got a tensor of shape {tuple(value.shape)} "
                f"dtype {value.dtype}; reduce it first, e.g. value.mean()"
            )
        if value.device.type == "meta":
            raise InputError(f"{label} is a meta tensor (no data); pass the computed value")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{label} must be a number or a 0-dim tensor, got {type(value).__name__}")
    try:
        float(value)
    except OverflowError:
        raise InputError(f"{label} = {value!r} does not fit a float; pass a float") from None


def _done_check(clock: StepClock | None, values: Mapping[str, Any]) -> Callable[[], bool]:
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


def _autocast_device(device: torch.device) -> str:
    return device.type if device.type in ("cuda", "cpu", "xpu", "mps") else ""


def _default_sinks() -> list[Sink]:
    """SQLite at ``$BATCHTAP_DB`` (else ``runs/batchtap.db``; a PostgreSQL URL there means
    PostgreSQL) plus the console: a run is stored and visible without any configuration."""
    from batchtap.sinks.console import Console

    url = store_url()
    store: Sink
    if url.startswith(("postgresql://", "postgres://")):
        from batchtap.sinks.postgres import Postgres

        store = Postgres(url)
    else:
        from batchtap.sinks.sqlite import SQLite

        store = SQLite(url.removeprefix("sqlite:///"))
    return [store, Console()]


#: every Tap made in this process (weakly): runs still open at interpreter exit are ended
_OPEN_AT_EXIT: weakref.WeakSet[Tap] = weakref.WeakSet()


@atexit.register
def _end_open_runs() -> None:
    for tap in list(_OPEN_AT_EXIT):
        tap._end_at_exit()

