"""The ``Tap``: the object a training loop talks to.

A ``Tap`` is configuration, the run's life cycle and the step call. Per run it owns a
:class:`~batchtap.capture.session.RunCapture` (the device ring, its clock, flusher and NaN guard),
made at the first step, and hands flushed blocks to the pipeline: a thread of this process
(:mod:`batchtap.pipeline.thread`) or a process of its own (:mod:`batchtap.pipeline.process`) that
decodes, validates, reduces across ranks, runs the rules and feeds the sinks. What comes back (rule
verdicts, the stop state, errors) waits in one :class:`~batchtap.pipeline.control.Control`, read at
step boundaries. Per step the training thread only launches a few small device ops and writes host
arrays; it never reads a device value.

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
import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing.util  # noqa: F401  (see _end_open_runs: its exit handler is registered first)
import os
import signal
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, cast

import torch

from batchtap import _env
from batchtap._config import to_json_config
from batchtap._defaults import checked_sinks, default_sinks
from batchtap._names import check_storable
from batchtap._owner import ThreadOwner
from batchtap.capture.accumulate import MicroBatches
from batchtap.capture.loader import timed_batches
from batchtap.capture.logged import Logged, check_logged, copy_check
from batchtap.capture.session import (
    CaptureConfig,
    RunCapture,
    autocast_device,
    check_device_context,
    compute_values,
)
from batchtap.capture.short import ShortStep, short_step
from batchtap.errors import ConfigError, DistributedError, InputError, RunStateError
from batchtap.metrics.base import Metric, StepInputs
from batchtap.metrics.defaults import default_metrics
from batchtap.metrics.inputs import (
    check_count,
    check_metrics,
    check_scalar,
    check_step_inputs,
    declared_extras,
    device_of,
    overflow_message,
    samples_of,
    signature,
)
from batchtap.pipeline import ranks
from batchtap.pipeline.agreement import ProcessGroups, RankAgreement
from batchtap.pipeline.chain import ReduceSpec
from batchtap.pipeline.control import Control
from batchtap.pipeline.core import PipelineSettings
from batchtap.pipeline.dispatch import Backpressure
from batchtap.pipeline.host import PipelineHost, PipelineKind, make_pipeline
from batchtap.records import Event, EventKind, RunInfo, RunStatus
from batchtap.recovery.actions import ActionRunner
from batchtap.recovery.rollback import Rollback
from batchtap.rules.engine import RuleEngine, RuleLike
from batchtap.sinks.base import Sink

__all__ = ["Tap"]

T = TypeVar("T")
log = logging.getLogger("batchtap")


#: dynamo's frame-evaluation switch (private; absent: torch's own disable wrapper does it all)
_set_eval_frame: Callable[[Any], Any] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "set_eval_frame", None
)
#: dynamo's list of code objects it never compiles (private, as above)
_skip_code: Callable[[Any], None] | None = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)


def _eager(method: T) -> T:
    """Exclude ``method`` from torch.compile tracing: traced, dynamo would guard on the step
    counter and recompile every step (host arrays and events cannot be traced anyway).

    ``torch.compiler.disable`` does that with a wrapper that costs ~0.4 us per call even when
    nothing is compiled, a tenth of the short step path. This wrapper carries the same mark, so a
    compiled caller graph-breaks at the call as it would at torch's; called from eager code (no
    frame-evaluation callback installed, one C call to find out) it calls the method directly, and
    otherwise hands over to torch's wrapper, which runs the method with dynamo off.
    """
    disabled: Any = torch.compiler.disable(method)  # type: ignore[arg-type]
    if _set_eval_frame is None or _skip_code is None:
        return disabled  # type: ignore[no-any-return]
    plain = cast(Callable[..., Any], method)

    def call(*args: Any, **kwargs: Any) -> Any:
        if _in_eager_code():  # nothing to turn off
            return plain(*args, **kwargs)
        return disabled(*args, **kwargs)

    functools.update_wrapper(call, plain)
    return cast(T, _skipped_by_dynamo(call, plain))


def _eager_entry(method: T) -> T:
    """Mark ``method`` as :func:`_eager` does, without a wrapper: the method itself must run its
    own work only when :func:`_in_eager_code` says so, and hand over to an :func:`_eager` method
    otherwise. For ``Tap.step``, whose short path is a few microseconds: a wrapper forwarding
    ``*args, **kwargs`` costs a tenth of that."""
    if _set_eval_frame is None or _skip_code is None:
        return method  # _in_eager_code() is then always False: every call takes the _eager method
    return cast(T, _skipped_by_dynamo(method, method))


def _skipped_by_dynamo(function: Any, plain: Any) -> Any:
    """Mark ``function`` as torch's ``disable`` marks its wrapper: a compiled caller graph-breaks
    at the call and runs it natively; dynamo then must not try to compile its frame either."""
    assert _skip_code is not None
    _skip_code(function.__code__)
    for name in ("_torchdynamo_disable", "_torchdynamo_disable_recursive"):
        setattr(function, name, True)
    function._torchdynamo_orig_callable = plain
    return function


def _in_eager_code() -> bool:
    """No frame-evaluation callback is installed: the caller is plain eager code (one C call to
    find out). False under a compiled caller, and where torch has no such switch."""
    if _set_eval_frame is None:
        return False
    prior = _set_eval_frame(None)
    if prior is None:
        return True
    _set_eval_frame(prior)
    return False


class _Terminated(BaseException):
    """SIGTERM arrived inside ``run()`` (a BaseException, like KeyboardInterrupt, so training code's
    ``except Exception`` does not swallow it)."""


@dataclasses.dataclass(slots=True)
class _RunState:
    info: RunInfo
    rank: int = 0
    writes: bool = True  # this process hands records to its sinks (rank 0 in a process group)
    step: int = 0  # global step: every step() call, sampled or not
    next_epoch: int = 0
    watching: bool = False
    # position of the batch the watched loader handed out last: epoch, batch, sampled, data wait
    epoch: int = 0
    batch: int = 0
    sampled: bool = True
    data_time: float = math.nan
    capture: RunCapture | None = None
    chain: Any = None  # the pipeline's handle for this run's blocks, made with the capture
    agreement: RankAgreement | None = None  # in a process group
    micro: MicroBatches | None = None  # accumulate() before the run's first step() made the capture
    sigterm_handler: Any = None  # the SIGTERM handler run() replaced, restored at its end
    owner: ThreadOwner = dataclasses.field(default_factory=ThreadOwner)  # the one thread that steps
    # log() values waiting for the next flush: (values, run id, rank, whether this rank writes)
    pending_logged: list[Logged] = dataclasses.field(default_factory=list)


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
        spool_dir: wrap every sink in a :class:`~batchtap.sinks.resilient.ResilientSink` that
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
        pipeline: where decoding, validation, rules and sinks run: ``"thread"`` (a thread of this
            process) or ``"process"`` (a process of their own, fed through shared memory, so
            sinks never hold this process's GIL; see docs/architecture.md "Pipeline process").

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
        pipeline: PipelineKind = "thread",
    ) -> None:
        check_int("flush_every", flush_every, 1)
        check_int("sample_every", sample_every, 1)
        check_int("queue_size", queue_size, 1)
        if not (isinstance(flush_seconds, (int, float)) and flush_seconds > 0):
            raise ConfigError(f"flush_seconds must be > 0, got {flush_seconds!r}")
        capacity = 4 * flush_every if capacity is None else capacity
        check_int("capacity", capacity, 1)
        if capacity < 2 * flush_every:
            raise ConfigError(
                f"capacity must be >= 2 * flush_every = {2 * flush_every} so rows are never overwritten "
                f"before their copy ran, got {capacity}; raise capacity or lower flush_every"
            )
        for label, seconds in (("collective_timeout", collective_timeout), ("end_timeout", end_timeout)):
            if not (isinstance(seconds, (int, float)) and 0 < seconds < math.inf):
                raise ConfigError(f"{label} must be a finite number of seconds > 0, got {seconds!r}")
        self.flush_every = flush_every
        self.flush_seconds = float(flush_seconds)
        self.sample_every = sample_every
        self.capacity = capacity
        self.nan_guard = nan_guard
        self.per_rank_rows = per_rank_rows
        self.collective_timeout = float(collective_timeout)
        self.exit_timeout = float(exit_timeout)
        self.end_timeout = float(end_timeout)
        self.handle_sigterm = handle_sigterm
        self._auto_metrics = metrics is None
        self._metrics = list(default_metrics(optimizer, model, scaler=scaler) if metrics is None else metrics)
        check_metrics(self._metrics)
        self._declared_extras = declared_extras(extras, self._metrics)
        engine = RuleEngine(rules) if rules or rollback is not None else None
        self._runner = ActionRunner(engine, rollback=rollback) if engine is not None else None
        # a NonFinite("loss") rule takes over the NaN guard's default stop: the guard then only
        # flushes at once, so the rule's own action (e.g. rollback) follows within a step or two
        self._loss_rule = engine is not None and any(r.handles_nonfinite_loss for r in engine.rules)
        self.sinks = checked_sinks(default_sinks() if sinks is None else sinks, spool_dir, rank=ranks.rank())
        self._control = Control()
        self._pipeline: PipelineHost = make_pipeline(
            pipeline, self.sinks, self._control, PipelineSettings(queue_size, backpressure, engine)
        )
        self._groups: ProcessGroups | None = None  # batchtap's gloo groups, made at the first run in a group
        self._state: _RunState | None = None
        self._last_capture: RunCapture | None = None
        # the open run's short step path (capture/short.py) and the input metadata it was built for
        self._short: ShortStep | None = None
        self._short_key: object = None
        self._short_candidate: object = None  # (signature, step) of the last general-path plain step
        self._closed = False
        _OPEN_AT_EXIT.add(self)  # weak: a run left open at interpreter exit is ended, never hangs

    # ------------------------------------------------------------------ life cycle

    @contextlib.contextmanager
    def run(self, name: str | None = None, *, config: Any = None, resume: str | None = None) -> Iterator[RunInfo]:
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
        first_step, stored_name = self._resume_point(resume) if resume is not None else (0, None)
        info = RunInfo(
            id=resume or uuid.uuid4().hex,
            name=name or stored_name or time.strftime("run-%Y%m%d-%H%M%S", time.localtime(started)),
            config=config_json,
            started_at=started,
            world_size=ranks.world_size(),
            environment=_env.environment(),
        )
        state = _RunState(info, step=first_step)
        if ranks.is_distributed():
            if self._groups is None:
                # collective calls: every rank makes them at its first run, in the same order
                self._groups = ProcessGroups.create(self.collective_timeout)
            state.agreement = RankAgreement(self._groups, self.collective_timeout)
            state.rank, state.writes = state.agreement.rank, state.agreement.rank == 0
            if resume is None:  # every rank's rows and events belong to the one run: rank 0's id
                info.id = ranks.shared_run_id(info.id, self._groups.agreement)
        self._state = state
        self._short = self._short_key = self._short_candidate = None
        _RUNNING.add(self)
        self._control.reset()
        self._last_capture = None
        self._pipeline.start_run(dataclasses.replace(info), writes=state.writes)
        # sync: run start — the run's row is stored before training starts, so a run killed before
        # its first flush can still be resumed (bounded; a down sink spools or reports it).
        if self._pipeline.drain(self.end_timeout):
            self._pipeline.flush_sinks(self.end_timeout)
        if as_repr:
            message = (
                f"config values stored as their repr (JSON cannot hold them): {', '.join(as_repr)}; "
                "pass str/int/float/bool/list/dict values to store them as such"
            )
            log.warning("batchtap: %s", message)
            self._send(state, [Event(info.id, first_step, EventKind.WARNING, message, started)])
        state.sigterm_handler = self._catch_sigterm()
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
        if status is RunStatus.FINISHED and self._control.stop_reason is not None:
            status, reason = RunStatus.STOPPED, self._control.stop_reason
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
        stored, names = self._pipeline.stored_position(run_id)
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
            if state.agreement is not None:
                state.agreement.close()
            if state.capture is not None:
                # in a process group an empty last block still carries late events through the reducer
                self._flush(state, empty_ok=state.agreement is not None)
                state.info.metrics = state.capture.layout.names
            state.info.status = status
            state.info.stop_reason = reason
            state.info.ended_at = time.time()
            self._pipeline.end_run(dataclasses.replace(state.info), writes=state.writes)
            # sync: end of run — every captured step reaches the sinks before run() returns, within end_timeout.
            self._pipeline.finish_run(
                state.info, timeout=self.end_timeout if timeout is None else timeout, last_step=state.step - 1
            )
        finally:
            self._state = None
            self._short = self._short_key = self._short_candidate = None
            _RUNNING.discard(self)

    def _end_at_exit(self) -> None:
        """Interpreter exit: a run still open is ended as failed, waiting at most ``exit_timeout``;
        then the pipeline ends (a pipeline process exits by itself rather than being terminated)."""
        if self._closed:
            return
        self._end_open_run_at_exit()
        self._pipeline.at_exit(timeout=self.exit_timeout)

    def _end_open_run_at_exit(self) -> None:
        state = self._state
        if state is None:
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
        self._pipeline.close(timeout=self.end_timeout)

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
        self._pipeline.start_epoch(state.info.id, state.epoch, total, writes=state.writes)
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

    @_eager_entry
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
        short = self._short
        if (
            short is not None
            and _in_eager_code()
            and short(loss, outputs, targets, batch_size, tokens, grad_norm, epoch, batch, extra)
        ):
            return
        self._step(loss, outputs, targets, extra, batch_size, tokens, grad_norm, epoch, batch)

    @_eager
    def _step(
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
        """:meth:`step`'s general path: every check, then the row (see ``capture/short.py``)."""
        state = self._require_run("step()")
        state.owner.check("step()")
        self._raise_pipeline_error()
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
                    state,
                    loss,
                    outputs,
                    targets,
                    extra or {},
                    batch_size,
                    tokens,
                    grad_norm,
                    ep,
                    index,
                    data_time,
                    micro,
                )
            except OverflowError:  # nothing was recorded yet: a number too large for a float
                raise InputError(overflow_message(extra or {}, tokens)) from None
        if micro is not None:
            micro.reset()
        state.step += 1
        if state.capture is not None:
            self._after_step(state, state.capture)

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
        """The general path of :meth:`step`: every check, then the row."""
        check_device_context(state.capture, loss, outputs)
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
        capture = state.capture
        if capture is None:
            inputs = StepInputs(loss, outputs, targets, samples, extra, grad_norm)
            capture = self._new_capture(state, inputs, micro if accumulated else None)
        inputs = StepInputs(loss, outputs, targets, samples, extra, grad_norm, device=capture.device)
        capture.record(inputs, state.step, epoch, batch, data_time, tokens=step_tokens, accumulated=accumulated)
        key = capture.fast_key
        if key is not None and key != self._short_key:
            # Built at the second plain step in a row with this signature: a loop whose shapes
            # change every step (dynamic padding) never pays for a closure it would not use, and an
            # epoch's short last batch leaves the closure of the common shape in place.
            if self._short_candidate == (key, state.step - 1):
                self._short_key = key
                self._short = short_step(
                    capture,
                    state,
                    inputs,
                    owner_thread=state.owner.ident or 0,
                    errors=self._control,
                    on_nan=lambda hit: self._on_nan(state, hit),
                    on_due=lambda: self._flush(state),
                )
            self._short_candidate = (key, state.step)

    def _after_step(self, state: _RunState, capture: RunCapture) -> None:
        """What follows every step, captured or not: NaN guard, flush, rule verdicts, next start mark."""
        if capture.guard is not None:
            self._poll_guard(state, capture)
        if capture.due():
            if state.agreement is not None:
                # Agree before handing the block over: the agreement's collective calls release the
                # GIL, and right after a hand-over the pipeline thread would take it for its decode.
                self._agree(state)
            self._flush(state)
        if self._runner is not None:
            if state.agreement is None:
                self._apply_verdicts(state, self._control.waiting)
            self._runner.after_step(state.step - 1)
        if not state.watching and state.step % self.sample_every == 0:
            self._arm_start(state)  # last, so the next step's time excludes our own flush

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
        self._raise_pipeline_error()
        check_device_context(state.capture, loss, outputs)
        if state.step % self.sample_every != 0:
            return  # this optimizer step is not sampled
        samples = samples_of(batch_size, outputs, targets)
        if tokens is not None:
            check_count("tokens", tokens)
        inputs = StepInputs(loss, outputs, targets, samples, {})
        capture = state.capture
        micro = capture.micro if capture is not None else state.micro
        if micro is None:
            device = device_of(inputs)
            inputs = dataclasses.replace(inputs, device=device)
            state.micro = micro = MicroBatches(self._select_metrics(inputs, micro=True), device)
        else:
            inputs = dataclasses.replace(inputs, device=micro.device)
        key = signature(inputs)
        if capture is None or key != capture.checked_micro:
            check_step_inputs(inputs, micro.metrics, micro.device, "accumulate()")
            if not micro.metrics and loss is None:
                raise InputError(
                    "accumulate() got nothing to measure; pass the micro-batch's loss (and outputs/targets)"
                )
            if capture is not None:
                capture.checked_micro = key
        if state.watching:
            micro.add_data_time(state.data_time)
        with torch.no_grad():
            values = compute_values(micro.metrics, inputs, autocast_device(micro.device))
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
        the sinks with the next flush, in one write with the rows of the steps before them (a
        reader of the store never sees those steps without them); ``flush()`` or the end of the
        run hands them over at once.

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
        check_logged(values, step, taken=state.capture.layout.names if state.capture is not None else ())
        if step is None:
            step = max(state.step - 1, 0)
        clock = state.capture.clock if state.capture is not None else None
        logged = Logged.capture(
            values, step=step, epoch=state.epoch, wall_time=time.time(), marker=lambda: copy_check(clock, values)
        )
        if state.capture is not None and state.agreement is None:
            # Handed over with the next flush, after the block of the steps before it: no flush of
            # its own (a Lightning module logging on every step would otherwise flush every step).
            state.pending_logged.append(logged)
        else:  # before the first step, or in a process group (which flushes at agreed steps only)
            self._pipeline.logged(logged, run_id=state.info.id, rank=state.rank, writes=state.writes)

    # ------------------------------------------------------------------ state and control

    @property
    def steps_recorded(self) -> int:
        """Rows captured in the current (or last) run."""
        return self._last_capture.rows if self._last_capture is not None else 0

    @property
    def should_stop(self) -> bool:
        """True once the NaN guard or a stop rule asked training to stop. Never blocks.

        In a process group it turns True on every rank at the same flush step.
        """
        state = self._state
        if self._control.local_stop is None and state is not None and state.capture is not None:
            self._poll_guard(state, state.capture)
        return self._control.stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """Why :attr:`should_stop` turned True, if it did."""
        return self._control.stop_reason

    @property
    def anomaly_counts(self) -> dict[str, int]:
        """Anomalies per value name in the current (or last) run, as far as the host has seen."""
        return dict(self._control.anomaly_counts)

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
        gate = self._pipeline.gate
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
        if self._pipeline.gate.paused:
            raise RunStateError(
                "flush() was called inside tap.paused(): the pipeline cannot read rows while paused; "
                "flush after the paused block"
            )
        state = self._state
        if state is not None and state.capture is not None:
            self._flush(state)
        # sync: explicit flush — the caller asked for every captured step on the host.
        self._pipeline.drain()
        self._pipeline.flush_sinks()

    def request_stop(self, reason: str, *, step: int | None = None, metric: str | None = None) -> None:
        """Ask training to stop: :attr:`should_stop` turns True (at the next flush step on every
        rank, in a process group) and the run ends as ``stopped`` with ``reason``.

        Thread-safe; the NaN guard and stop rules call it.
        """
        state = self._state
        step = step if step is not None else (state.step - 1 if state else 0)
        if not self._control.request_stop(reason, step) or state is None:
            return
        event = Event(
            state.info.id, step, EventKind.ACTION, f"stop: {reason}", time.time(), metric=metric, rank=state.rank
        )
        self._send(state, [event])
        if state.agreement is None:
            self._control.agree_stop(reason)  # one process: nobody to agree with

    # ------------------------------------------------------------------ internals

    def _require_run(self, what: str) -> _RunState:
        if self._state is None:
            raise RunStateError(f"{what} was called outside a run; wrap the training loop in `with tap.run(name=...):`")
        return self._state

    def _raise_pipeline_error(self) -> None:
        """Raise what the pipeline reported (a failure, or an input error only values revealed)."""
        error = self._control.take_error()
        if error is not None:
            raise error

    def _select_metrics(self, inputs: StepInputs, *, micro: bool) -> list[Metric]:
        """The per-micro-batch (``micro``) or per-step metrics of this run; default metrics whose
        inputs the first call lacks (or that do not fit them, e.g. accuracy of float targets) are left out."""
        chosen = [m for m in self._metrics if m.per_micro_batch == micro]
        if self._auto_metrics:
            chosen = [m for m in chosen if m.applies(inputs)]
        return chosen

    def _new_capture(self, state: _RunState, inputs: StepInputs, micro: MicroBatches | None) -> RunCapture:
        """Make the run's capture at its first captured step, and the pipeline's chain for it."""
        device = micro.device if micro is not None else device_of(inputs)
        inputs = dataclasses.replace(inputs, device=device)
        chosen = {id(m) for m in (micro.metrics if micro is not None else self._select_metrics(inputs, micro=True))}
        chosen |= {id(m) for m in self._select_metrics(inputs, micro=False)}
        config = CaptureConfig(
            capacity=self.capacity,
            flush_every=self.flush_every,
            flush_seconds=None if state.agreement else self.flush_seconds,  # ranks flush at the same steps
            nan_guard=self.nan_guard,
            fast_path=self.sample_every == 1 and state.agreement is None and self._runner is None,
        )
        metrics = [m for m in self._metrics if id(m) in chosen]
        capture = RunCapture.create(metrics, inputs, micro, config, self._declared_extras)
        reduce = None
        if state.agreement is not None and self._groups is not None:
            reduce = ReduceSpec(self._groups.reduce, state.rank, state.agreement.world_size, self.per_rank_rows)
        state.chain = self._pipeline.open_chain(
            capture.layout,
            run_id=state.info.id,
            rank=state.rank,
            writes=state.writes,
            reduce=reduce,
            max_rows=self.capacity,  # a block never holds more than a ring
        )
        state.capture = self._last_capture = capture
        state.micro = None  # the capture owns it from here
        state.info.metrics = capture.layout.names
        state.info.environment["device"] = str(device)  # known from the first step; stored with the run's end
        return capture

    def _arm_start(self, state: _RunState) -> None:
        if state.capture is not None:  # the ring is made at the first step; that step has no measured start
            state.capture.arm_start()

    def _flush(self, state: _RunState, *, empty_ok: bool = False) -> None:
        capture = state.capture
        assert capture is not None
        block = capture.flush(empty_ok=empty_ok)
        pending, state.pending_logged = state.pending_logged, []
        if block is not None:
            # log() values travel with the block of the steps they follow: stored in one write, so
            # a reader never sees those steps without them (nor them before those steps).
            self._pipeline.submit(capture.flusher, block, state.chain, pending)
        else:
            for logged in pending:
                self._pipeline.logged(logged, run_id=state.info.id, rank=state.rank, writes=state.writes)

    def _poll_guard(self, state: _RunState, capture: RunCapture) -> None:
        hit = capture.poll_nan()
        if hit is not None:
            self._on_nan(state, hit)

    def _on_nan(self, state: _RunState, hit: tuple[int, float]) -> None:
        """The NaN guard saw a non-finite loss: stop, or let a NonFinite("loss") rule decide."""
        if self._control.local_stop is not None:
            return
        step, value = hit
        if self._loss_rule:
            if state.agreement is None:
                # The rules own this decision: hand them the row now and let them decide before
                # the next step (in a process group they decide at the next flush step instead).
                self._flush(state)
                # sync: rare path — a non-finite loss was seen; wait for the rules' verdict on it.
                self._pipeline.drain()
                self._apply_verdicts(state, self._control.waiting)
            return
        self.request_stop(f"non-finite loss {value!r} at step {step}", step=step, metric="loss")

    def _agree(self, state: _RunState) -> None:
        """At a flush step: agree with every rank on stopping and on the rule verdicts to apply."""
        assert state.agreement is not None
        try:
            agreed = state.agreement.exchange(self._control, state.step - 1)
        except DistributedError:
            if state.chain is not None:
                self._pipeline.ranks_failed(state.chain, "the agreement exchange failed")
            raise
        if self._runner is not None:
            self._apply_verdicts(state, agreed)  # every rank applies the same verdicts at this step

    def _apply_verdicts(self, state: _RunState, count: int) -> None:
        """Apply the next ``count`` rule verdicts (training thread)."""
        runner = self._runner
        assert runner is not None
        stop: str | None = None
        try:
            for verdict in self._control.take_verdicts(count):
                outcome = runner.apply(verdict.decisions, step=state.step - 1, cleared_through=verdict.cleared_through)
                stop = stop or outcome.reason
        finally:
            self._send(state, runner.take_events())
        if stop is not None and self._control.local_stop is None:
            self.request_stop(stop)
            # every rank applied the same verdicts at this same step: the stop is already agreed
            self._control.agree_stop(stop)

    def _send(self, state: _RunState, events: list[Event]) -> None:
        self._pipeline.events(events, state.chain)


# ---------------------------------------------------------------------- helpers


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


#: every Tap made in this process (weakly): runs still open at interpreter exit are ended
_OPEN_AT_EXIT: weakref.WeakSet[Tap] = weakref.WeakSet()
#: Taps with an open run, held strongly: a script that drops its last reference to a Tap mid-run
#: (an exception unwinding the frame that held it) still has that run ended at exit
_RUNNING: set[Tap] = set()

# Registered after multiprocessing's own exit handler (imported just above), so it runs before it:
# a run's pipeline process must store the run's end before multiprocessing terminates it.


@atexit.register
def _end_open_runs() -> None:
    for tap in list(_RUNNING) + [t for t in list(_OPEN_AT_EXIT) if t not in _RUNNING]:
        tap._end_at_exit()
