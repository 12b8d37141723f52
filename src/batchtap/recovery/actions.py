"""The training-thread side of the rules: apply decisions at the next ``step()``.

The rule engine decides on the pipeline thread; everything that touches training state (the model,
the optimizer, the loop's control flow) happens here, on the thread that owns it, between two steps.
:class:`ActionRunner` is the one object the Tap calls for that:

* ``apply(decisions, step=k, cleared_through=c)`` inside ``Tap.step(k)``, with what the pipeline sent
  since the last call. It resizes samplers, rolls back, and sets the stop flag, in step order, then
  confirms the rollback snapshots the rules have cleared. ``raise`` raises
  :class:`~batchtap.errors.TrainingDiverged` out of it (its event is queued first).
* ``after_step(k)`` at the end of ``Tap.step(k)``: lets the rollback take its periodic snapshot.
* ``should_skip(epoch, batch)`` for each batch the watched loader yields: True for the batches a
  rollback asked to skip.
* ``take_events()``: the action events to send to the sinks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

from batchtap.errors import ConfigError
from batchtap.records import Event, EventKind
from batchtap.recovery.rollback import Rollback, RollbackResult
from batchtap.rules.base import Action, Decision
from batchtap.rules.engine import RuleEngine

__all__ = ["ActionRunner", "Outcome"]


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """What one :meth:`ActionRunner.apply` call did.

    Attributes:
        stop: a decision asked training to stop (sticky: see :attr:`ActionRunner.stop_reason`).
        reason: why, from the first stop decision.
        rollbacks: the rollbacks performed.
        batch_sizes: the batch sizes set, in order.
        ignored: decisions skipped because a rollback had abandoned their trajectory.
    """

    stop: bool = False
    reason: str | None = None
    rollbacks: tuple[RollbackResult, ...] = ()
    batch_sizes: tuple[int, ...] = ()
    ignored: int = 0


class ActionRunner:
    """Applies rule decisions on the training thread.

    Args:
        actions: the engine whose decisions it will apply (or the set of actions they may carry);
            checked against what is available.
        rollback: required when some rule may roll back.

    Raises:
        ConfigError: a rule may roll back but no :class:`~batchtap.recovery.rollback.Rollback` is given.

    Example:
        >>> from batchtap.rules import NonFinite, RuleEngine
        >>> from batchtap.records import Record
        >>> engine = RuleEngine([NonFinite("loss")])
        >>> runner = ActionRunner(engine)
        >>> ds = engine.process([Record("r", step=3, epoch=0, batch=3, rank=0, wall_time=0.0,
        ...                             values={"loss": float("nan")})])
        >>> runner.apply(ds, step=4, cleared_through=engine.cleared_through).stop
        True
        >>> runner.stop_reason
        'nonfinite(loss) at step 3: loss is nan at step 3 (expected a finite value)'
    """

    def __init__(self, actions: RuleEngine | Iterable[Action], *, rollback: Rollback | None = None) -> None:
        wanted = actions.actions if isinstance(actions, RuleEngine) else frozenset(Action(a) for a in actions)
        if Action.ROLLBACK in wanted and rollback is None:
            raise ConfigError(
                "a rule has action 'rollback' but no Rollback was given; expected a "
                "batchtap.Rollback(model, optimizer, ...). Fix: pass rollback=Rollback(...) or drop the action."
            )
        self.rollback = rollback
        self._stop_reason: str | None = None
        self._events: list[Event] = []
        self._skipped: list[tuple[int, int]] = []
        self._skip_step = 0
        self._skip_run_id = ""

    @property
    def stop_requested(self) -> bool:
        """Whether some decision asked training to stop (``tap.should_stop``)."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """Why, from the first stop decision; ``None`` while training should go on."""
        return self._stop_reason

    def apply(self, decisions: Sequence[Decision], *, step: int, cleared_through: int | None = None) -> Outcome:
        """Apply ``decisions`` (step order) at training step ``step``, then confirm cleared snapshots.

        Args:
            decisions: what the engine returned since the last call, in order.
            step: the current training step (the one ``Tap.step()`` is recording).
            cleared_through: the engine's ``cleared_through`` when it produced them.

        Raises:
            TrainingDiverged: a decision with ``raise``, or a rollback out of retries with
                ``on_exhausted="raise"``.
        """
        stop: str | None = None
        rollbacks: list[RollbackResult] = []
        sizes: list[int] = []
        ignored = 0
        for d in decisions:
            if self.rollback is not None and self.rollback.is_stale(d.step):
                ignored += 1
                self._event(d, step, f"ignored {d.rule} at step {d.step}: a rollback abandoned that trajectory")
                continue
            if d.wants(Action.BATCH_SIZE) and d.sampler is not None and d.batch_size is not None:
                before = d.sampler.batch_size
                applied = d.sampler.set_batch_size(d.batch_size)
                sizes.append(applied)
                self._event(d, step, f"batch size {before} -> {applied} ({d.rule} at step {d.step}: {d.message})")
            if d.wants(Action.ROLLBACK):
                if self.rollback is None:
                    raise ConfigError(f"{d.rule} asks for a rollback but the ActionRunner has no Rollback.")
                result = self.rollback.restore(d, step=step)
                if result is not None:
                    rollbacks.append(result)
                    self._event(d, step, result.message)
                    if result.exhausted:
                        stop = stop or result.message
            if d.wants(Action.STOP):
                reason = f"{d.rule} at step {d.step}: {d.message}"
                stop = stop or reason
                self._event(d, step, f"stop requested by {reason}")
            if d.wants(Action.RAISE):
                error = d.to_error()
                self._event(d, step, f"raise TrainingDiverged: {error}")
                raise error
        if stop is not None and self._stop_reason is None:
            self._stop_reason = stop
        if cleared_through is not None and self.rollback is not None:
            self.rollback.confirm(cleared_through)
        return Outcome(
            stop=stop is not None,
            reason=stop,
            rollbacks=tuple(rollbacks),
            batch_sizes=tuple(sizes),
            ignored=ignored,
        )

    def after_step(self, step: int) -> None:
        """End of ``Tap.step(step)``: give the rollback its chance to snapshot (no host sync)."""
        if self.rollback is not None and not self.stop_requested:
            self.rollback.maybe_snapshot(step)

    def should_skip(self, epoch: int, batch: int, *, step: int = 0, run_id: str = "") -> bool:
        """For each batch the loader yields: True if a rollback asked to skip it.

        When the last batch of a skip run is consumed, an action event names every skipped batch.

        Args:
            epoch: the batch's epoch.
            batch: its index within the epoch.
            step: the global step counter at that point (for the event).
            run_id: the run (for the event).
        """
        if self.rollback is None or not self.rollback.should_skip():
            return False
        self._skipped.append((epoch, batch))
        if self.rollback.skip_left == 0:
            named = ", ".join(f"{e}:{b}" for e, b in self._skipped)
            self._events.append(
                Event(
                    run_id=run_id,
                    step=step,
                    kind=EventKind.ACTION,
                    message=f"rollback {self.rollback.retries}: skipped batches (epoch:batch) {named}",
                    wall_time=time.time(),
                )
            )
            self._skipped = []
        return True

    def take_events(self) -> list[Event]:
        """Return and forget the action events queued since the last call."""
        events, self._events = self._events, []
        return events

    def _event(self, d: Decision, step: int, message: str) -> None:
        self._events.append(
            Event(
                run_id=d.run_id,
                step=step,
                kind=EventKind.ACTION,
                message=message,
                wall_time=time.time(),
                metric=d.metric,
                rank=d.rank,
            )
        )
