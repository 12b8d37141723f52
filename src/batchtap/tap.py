"""The ``Tap``: the object a training loop talks to.

A ``Tap`` is configuration, the run's life cycle and the step call. Per run it owns a
:class:`~batchtap.capture.session.RunCapture` (the device ring, its clock, flusher and NaN guard),
made at the first step, and hands flushed blocks to the pipeline: a thread of this process
(:mod:`batchtap.pipeline.transport.thread`) or a process of its own (:mod:`batchtap.pipeline.transport.process`) that
decodes, validates, reduces across ranks, runs the rules and feeds the sinks. What comes back (rule
verdicts, the stop state, errors) waits in one :class:`~batchtap.pipeline.chain.control.Control`, read at
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

import contextlib
import dataclasses
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch

from batchtap import _env, _stale
from batchtap._config import to_json_config
from batchtap._defaults import checked_metrics, checked_numbers, checked_sinks, default_sinks
from batchtap._exit import AT_EXIT, Terminated, catch_sigterm, ending_of, sigterm_received
from batchtap._names import check_storable
from batchtap._run import ActiveRun, HandedRows, RunSettings, report, resume_point, run_labels
from batchtap._run_metrics import RunMetrics
from batchtap.capture.eager import eager, eager_entry, in_eager_code
from batchtap.errors import ConfigError, InputError, RunStateError
from batchtap.metrics.base import Metric
from batchtap.metrics.defaults import default_metrics
from batchtap.metrics.inputs import (
    check_metrics,
    declared_extras,
)
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.core import PipelineSettings
from batchtap.pipeline.chain.dispatch import Backpressure
from batchtap.pipeline.ranks import group as ranks
from batchtap.pipeline.ranks.agreement import ProcessGroups, RankAgreement
from batchtap.pipeline.transport.host import PipelineHost, PipelineKind
from batchtap.pipeline.transport.make import make_pipeline
from batchtap.records import Event, EventKind, RunInfo, RunStatus
from batchtap.recovery.actions import ActionRunner
from batchtap.recovery.rollback import Rollback
from batchtap.rules.engine import RuleEngine, RuleLike
from batchtap.sinks.base import Sink

__all__ = ["Tap"]

T = TypeVar("T")
log = logging.getLogger("batchtap")


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
        rollback: the :class:`~batchtap.recovery.Rollback` that ``rollback`` actions restore from.
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
        fit_metrics: drop the metrics whose inputs the run's first step lacks (accuracy of a loss-only
            loop) instead of raising; default: only for the default metrics (``bt.autolog`` sets it).

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
        fit_metrics: bool | None = None,
    ) -> None:
        capacity = checked_numbers(
            flush_every, flush_seconds, sample_every, queue_size, capacity, collective_timeout, end_timeout
        )
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
        chosen = default_metrics(optimizer, model, scaler=scaler) if metrics is None else checked_metrics(metrics)
        check_metrics(chosen)
        engine = RuleEngine(rules) if rules or rollback is not None else None
        self._runner = ActionRunner(engine, rollback=rollback) if engine is not None else None
        # a NonFinite("loss") rule takes over the NaN guard's default stop: the guard then only
        # flushes at once, so the rule's own action (e.g. rollback) follows within a step or two
        self._settings = RunSettings(
            metrics=tuple(chosen),
            auto_metrics=metrics is None if fit_metrics is None else bool(fit_metrics),
            declared_extras=declared_extras(extras, chosen),
            capacity=capacity,
            flush_every=flush_every,
            flush_seconds=float(flush_seconds),
            sample_every=sample_every,
            nan_guard=nan_guard,
            per_rank_rows=per_rank_rows,
            loss_rule=engine is not None and any(r.handles_nonfinite_loss for r in engine.rules),
        )
        self.sinks = checked_sinks(default_sinks() if sinks is None else sinks, spool_dir, rank=ranks.rank())
        self._control = Control()
        _stale.sweep_segments(once=True)  # shared memory that killed batchtap processes on this host left
        self._pipeline: PipelineHost = make_pipeline(
            pipeline, self.sinks, self._control, PipelineSettings(queue_size, backpressure, engine)
        )
        self._groups: ProcessGroups | None = None  # batchtap's gloo groups, made at the first run in a group
        self._run: ActiveRun | None = None  # the open run
        self.run_metrics = RunMetrics(self, lambda tap: tap._run)  # for integrations: see _run_metrics.py
        self._sigterm_handler: Any = None  # the SIGTERM handler run() replaced, restored at its end
        self._last_run: ActiveRun | None = None
        self._closed = False
        AT_EXIT.register(self, Tap._end_at_exit)  # weakly: a run left open at interpreter exit is ended, never hangs

    # ------------------------------------------------------------------ life cycle

    @contextlib.contextmanager
    def run(
        self,
        name: str | None = None,
        *,
        config: Any = None,
        resume: str | None = None,
        tags: Sequence[str] = (),
        notes: str | None = None,
    ) -> Iterator[RunInfo]:
        """Context of one training run. Leaving it, however it is left, stores every captured step.

        Args:
            name: a label for the run (several runs may share one). Resuming without a name keeps
                the stored run's name.
            config: settings stored with the run: a mapping, an ``argparse.Namespace`` or a
                dataclass; paths, enums, dtypes and devices are stored as text, anything else that
                JSON cannot hold as its ``repr`` (with a warning).
            resume: id, or unique id prefix (``batchtap runs``' short id), of an earlier run to continue:
                it keeps its id and its steps continue after the last one a sink (SQLite, PostgreSQL)
                has stored, so a restart after a crash neither duplicates nor skips keys.
            tags: labels for the run (``"sweep-3"``, ``"baseline"``): shown and filtered on in
                ``batchtap runs`` and the browser view; ``batchtap tag`` changes them later.
            notes: a free-text note stored with the run.

        Yields:
            the run's :class:`~batchtap.RunInfo`.
        """
        info = self.start(name, config=config, resume=resume, tags=tags, notes=notes)
        status, reason = RunStatus.FINISHED, None
        terminated = False
        try:
            yield info
        except Terminated as exc:
            (status, reason), terminated = ending_of(exc), True
        except BaseException as exc:
            status, reason = ending_of(exc)
            raise
        finally:
            if self._run is not None and self._run.info is info:  # not ended at interpreter exit
                self.finish(status, reason=reason)
        if terminated:
            # Everything is stored: now end the way SIGTERM ends this process without us.
            self.close()
            os.kill(os.getpid(), signal.SIGTERM)

    def start(
        self,
        name: str | None = None,
        *,
        config: Any = None,
        resume: str | None = None,
        tags: Sequence[str] = (),
        notes: str | None = None,
    ) -> RunInfo:
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
        if self._run is not None:
            raise RunStateError(f"run {self._run.info.name!r} is still active; runs of one Tap cannot nest")
        for label, text in (("run name", name), ("resume id", resume)):
            if text is not None:
                if not isinstance(text, str):
                    raise InputError(f"{label} must be a string or None, got {type(text).__name__}")
                check_storable(label, text)
        labels = run_labels(tags, notes)
        try:
            config_json, as_repr = to_json_config(config)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
        config_json = _env.scrub_secrets(config_json)  # passwords and tokens are never stored
        started = time.time()
        resume, first_step, stored_name = resume_point(self._pipeline, resume, self.sinks)
        info = RunInfo(
            id=resume or uuid.uuid4().hex,
            name=name or stored_name or time.strftime("run-%Y%m%d-%H%M%S", time.localtime(started)),
            config=config_json,
            started_at=started,
            world_size=ranks.world_size(),
            environment={**_env.environment(), **labels},
        )
        agreement = None
        if ranks.is_distributed():
            if self._groups is None:
                # collective calls: every rank makes them at its first run, in the same order
                self._groups = ProcessGroups.create(self.collective_timeout)
            agreement = RankAgreement(self._groups, self.collective_timeout)
            if resume is None:  # every rank's rows and events belong to the one run: rank 0's id
                info.id = ranks.shared_run_id(info.id, self._groups.agreement)
        run = ActiveRun(
            info,
            self._settings,
            self._pipeline,
            self._control,
            self._runner,
            first_step=first_step,
            agreement=agreement,
            groups=self._groups,
        )
        self._run = self._last_run = run
        AT_EXIT.running(self, True)
        self._control.reset()
        self._pipeline.start_run(dataclasses.replace(info), writes=run.writes)
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
            run.send([Event(info.id, first_step, EventKind.WARNING, message, started)])
        self._sigterm_handler = catch_sigterm(self.handle_sigterm)
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
        _open(self._run, "finish()")
        status = RunStatus(status)
        if status is RunStatus.RUNNING:
            raise ConfigError("finish() needs a final status: 'finished', 'failed' or 'stopped'")
        if status is RunStatus.FINISHED and self._control.stop_reason is not None:
            status, reason = RunStatus.STOPPED, self._control.stop_reason
        handler, self._sigterm_handler = self._sigterm_handler, None
        try:
            self._finish(status, reason)
        finally:
            if handler is not None:
                signal.signal(signal.SIGTERM, handler)

    def _finish(self, status: RunStatus, reason: str | None, *, timeout: float | None = None) -> None:
        run = self._run
        assert run is not None
        timeout = self.end_timeout if timeout is None else timeout
        found: BaseException | None = None
        try:
            run.close()
            if status is RunStatus.FINISHED:
                # sync: end of run — the last blocks are checked before the run's status is stored:
                # an error only their values reveal (a class index out of range) fails the run and
                # is raised below, where a later step() would have raised it
                self._pipeline.drain(timeout)
                found = self._control.take_error()
                if found is not None:
                    status, reason = RunStatus.FAILED, f"{type(found).__name__}: {found}"
            run.info.status = status
            run.info.stop_reason = reason
            run.info.ended_at = time.time()
            self._pipeline.end_run(dataclasses.replace(run.info), writes=run.writes)
            # sync: end of run — every captured step reaches the sinks before run() returns, within end_timeout.
            self._pipeline.finish_run(run.info, timeout=timeout, last_step=run.step - 1)
        finally:
            self._run = None
            AT_EXIT.running(self, False)
        if found is not None:
            raise found

    def _end_at_exit(self) -> None:
        """Interpreter exit: a run still open is ended as failed, waiting at most ``exit_timeout``;
        then the pipeline ends (a pipeline process exits by itself rather than being terminated)."""
        if self._closed:
            return
        if self._run is not None:
            self._sigterm_handler = None  # signal handlers no longer matter at exit
            status, reason = RunStatus.FAILED, "the process exited with the run still open (finish() was never called)"
            if sigterm_received():  # SIGTERM unwound the script: stopped, as inside run()
                status, reason = RunStatus.STOPPED, "SIGTERM"
            try:
                self._finish(status, reason, timeout=self.exit_timeout)
            except Exception:  # never turn interpreter exit into a traceback of ours
                log.exception("batchtap: ending the open run at exit failed")
        self._pipeline.at_exit(timeout=self.exit_timeout)

    def close(self) -> None:
        """Stop the pipeline and close every sink. Idempotent.

        A run still open (``start()`` without ``finish()``) is ended first, as ``failed`` with the
        reason "close() was called with the run still open", every captured step stored: closing
        never drops what was recorded. Leaving a ``with tap:`` block ends it by how the block ended.
        """
        if self._closed:
            return
        if self._run is not None:
            self.finish(
                RunStatus.FAILED, reason="close() was called with the run still open (finish() was never called)"
            )
        self._closed = True
        self._pipeline.close(timeout=self.end_timeout)

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        """Leave ``with tap:``: a run still open (``tap.start()`` inside the block) is ended
        ``finished``, or ``failed``/``stopped`` by the exception leaving the block (as
        :meth:`run` ends its run); then :meth:`close`."""
        try:
            if self._run is not None and not self._closed:
                status, reason = ending_of(error)
                self.finish(status, reason=reason)  # raises an input error only the last rows revealed
        finally:
            self.close()

    # ------------------------------------------------------------------ the loop

    def watch(self, loader: Iterable[T], *, epoch: int | None = None) -> Iterator[T]:
        """Iterate ``loader``, numbering batches and timing the wait for each.

        Args:
            loader: any iterable of batches (a ``DataLoader`` usually).
            epoch: the epoch number; default: one more than the last watched epoch.
        """
        return _open(self._run, "watch()").watch(loader, epoch)

    @eager_entry
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
        run = self._run
        if run is not None:
            short = run.short
            if (
                short is not None
                and in_eager_code()
                and short(loss, outputs, targets, batch_size, tokens, grad_norm, epoch, batch, extra)
            ):
                return
        self._step(loss, outputs, targets, extra, batch_size, tokens, grad_norm, epoch, batch)

    @eager
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
        """:meth:`step`'s general path (see ``batchtap._run``), with dynamo off."""
        _open(self._run, "step()").take_step(loss, outputs, targets, extra, batch_size, tokens, grad_norm, epoch, batch)

    @eager
    def accumulate(
        self,
        loss: torch.Tensor | None = None,
        *,
        outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        batch_size: int | None = None,
        tokens: int | None = None,
        data_time: float | None = None,
    ) -> None:
        """Add one micro-batch to the optimizer step that the next :meth:`step` call closes.

        Sums stay on the device (no host read). The step's record then holds the sample-weighted
        mean of the micro-batch losses, accuracy over every counted target of every micro-batch,
        ``step_time`` from the first micro-batch's start to ``step()``, throughput over all of the
        step's samples (or ``tokens``), and the summed loader wait: the watched loader's, or
        ``data_time`` (seconds on a host clock) from a caller that times its own fetches.

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
        _open(self._run, "accumulate()").accumulate(loss, outputs, targets, batch_size, tokens, data_time)

    @eager
    def log(
        self, values: Mapping[str, torch.Tensor | float], *, step: int | None = None, epoch: int | None = None
    ) -> None:
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
            step: the training step the values belong to (default: the last captured step;
                before a new run's first step: step 0, the step of its first record, stored with
                an earlier wall time so readers list them before that record; before a resumed
                run's first step: the last step stored before the resume).
            epoch: the epoch they belong to (default: the watched loader's, else the last hand-over's).

        Example:
            >>> import torch, batchtap as bt
            >>> tap = bt.Tap(sinks=[])
            >>> with tap, tap.run():
            ...     tap.step(loss=torch.tensor(0.7))
            ...     tap.log({"val_loss": 0.31, "val_acc": torch.tensor(0.9)})
        """
        _open(self._run, "log()").log(values, step, epoch)

    # ------------------------------------------------------------------ state and control

    @property
    def steps_recorded(self) -> int:
        """Rows captured in the current (or last) run."""
        run = self._last_run
        return 0 if run is None else run.capture.rows if run.capture is not None else run.outside_rows

    @property
    def should_stop(self) -> bool:
        """True once the NaN guard or a stop rule asked training to stop. Never blocks.

        In a process group it turns True on every rank at the same flush step.
        """
        if self._control.local_stop is None and self._run is not None:
            self._run.poll_guard()
        return self._control.stop_reason is not None

    @property
    def metrics(self) -> tuple[Metric, ...]:
        """The metrics this Tap was given (or the defaults it chose), in order. A run records those
        that fit its first step; extras and a ``grad_norm=`` column are added to the run's own set."""
        return self._settings.metrics

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
        return self._run.info if self._run is not None else None

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
        if self._run is not None and self._run.capture is not None:
            self._run.flush()
        # sync: explicit flush — the caller asked for every captured step on the host.
        self._pipeline.drain()
        self._pipeline.flush_sinks()

    def request_stop(self, reason: str, *, step: int | None = None, metric: str | None = None) -> None:
        """Ask training to stop: :attr:`should_stop` turns True (at the next flush step on every
        rank, in a process group) and the run ends as ``stopped`` with ``reason``.

        Thread-safe; the NaN guard and stop rules call it.
        """
        if self._run is not None:
            self._run.request_stop(reason, step=step, metric=metric)
        else:
            self._control.request_stop(reason, step if step is not None else 0)

    def hand_over(self, metrics: Sequence[Metric], rows: HandedRows) -> int:
        """Rows a capture outside batchtap's ring read back itself (TensorFlow's), into this run's
        pipeline as :meth:`step`'s rows go (decoding, domain checks, anomalies, rules, sinks, NaN
        stop). For capture back-ends. Returns the run's step of ``rows``' offset 0."""
        return _open(self._run, "hand_over()").hand_over(metrics, rows)

    def warn(self, message: str, *, info: bool = False) -> None:
        """Store a warning event with the open run (and log it): what a tool driving this Tap
        (``bt.autolog``) could not see. ``info=True``: a note instead (kind ``info``, a choice or
        assumption it made), printed once by the console sink. Outside a run: only logged."""
        report(self._run, message, info=info)


# ---------------------------------------------------------------------- helpers


def _open(run: ActiveRun | None, what: str) -> ActiveRun:
    """The open run, or the error that says how to open one."""
    if run is None:
        raise RunStateError(f"{what} was called outside a run; wrap the training loop in `with tap.run(name=...):`")
    return run
