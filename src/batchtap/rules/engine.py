"""The rule engine: runs every rule on each decoded record, in step order, and says what to do.

It is plain host logic with no threads, locks, clocks or tensors of its own: the same records give the
same decisions on every rank and in every test. The Tap calls :meth:`RuleEngine.process` on its
pipeline thread and hands the decisions to the training thread (see
:class:`~batchtap.recovery.actions.ActionRunner`), which applies them at its next ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Union

from batchtap._validate import require_int
from batchtap.errors import ConfigError
from batchtap.records import Event, EventKind, Record
from batchtap.rules.base import Action, AlertHook, Anomaly, CallableRule, Decision, History, Rule, RuleFn

__all__ = ["Agreement", "RuleEngine", "RuleLike"]

#: What :class:`RuleEngine` accepts as a rule: a :class:`Rule`, or a function wrapped with action ``alert``.
RuleLike = Union[Rule, RuleFn]
#: Cross-rank agreement: ``(step, fired flags, one per rule) -> agreed flags``. The distributed layer
#: passes e.g. an all-reduce(max) so that one rank's anomaly acts on every rank.
Agreement = Callable[[int, Sequence[bool]], Sequence[bool]]


class RuleEngine:
    """Runs rules over records in step order and returns the decisions they make.

    For each record, each rule (in the order given) that carries its metric is checked against its
    state from earlier records; then, after the optional cross-rank ``agree`` step, every rule
    updates with the agreed outcome; then the record joins the shared :class:`History`. A rule does
    not fire on steps before its ``warmup``.

    Args:
        rules: :class:`Rule` s, or functions ``(record, history) -> Anomaly | None`` (action ``alert``).
        history: values per metric kept for ``Decision.recent`` and for function rules.
        agree: cross-rank agreement on the fired flags of one record (default: none, this rank decides).
        on_alert: called on this thread for every decision with ``alert``, after the rule's own hook.

    Raises:
        ConfigError: not a rule, two rules with the same name, or ``history < 1``.

    Example:
        >>> from batchtap.rules import NonFinite, Threshold
        >>> engine = RuleEngine([NonFinite("loss"), Threshold("accuracy", below=0.5, patience=2)])
        >>> rec = lambda s, loss, acc: Record("r", step=s, epoch=0, batch=s, rank=0, wall_time=0.0,
        ...                                   values={"loss": loss, "accuracy": acc})
        >>> ds = engine.process([rec(0, 0.9, 0.4), rec(1, 0.8, 0.45), rec(2, float("inf"), 0.6)])
        >>> [(d.step, d.rule, [a.value for a in d.actions]) for d in ds]
        [(1, 'threshold(accuracy<0.5)', ['alert']), (2, 'nonfinite(loss)', ['stop'])]
        >>> engine.cleared_through  # steps whose records no stop/raise/rollback rule flagged
        1
        >>> [e.kind.value for e in engine.take_events()]
        ['anomaly', 'anomaly']
    """

    def __init__(
        self,
        rules: Iterable[RuleLike],
        *,
        history: int = 64,
        agree: Agreement | None = None,
        on_alert: AlertHook | None = None,
    ) -> None:
        require_int("RuleEngine", "history", history, minimum=1)
        built: list[Rule] = []
        for r in rules:
            if isinstance(r, Rule):
                built.append(r)
            elif callable(r):
                built.append(CallableRule(r))
            else:
                raise ConfigError(
                    f"RuleEngine: expected a Rule or a callable (record, history) -> Anomaly | None, got {r!r}."
                )
        names = [r.name for r in built]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(
                f"RuleEngine: rule names must be unique (events name the rule), got duplicates {dupes}. "
                "Fix: pass name= to one of them."
            )
        if on_alert is not None and not callable(on_alert):
            raise ConfigError(f"RuleEngine: on_alert must be callable, got {type(on_alert).__name__}.")
        self.rules: tuple[Rule, ...] = tuple(built)
        self.history = History(maxlen=history)
        self._agree = agree
        self._on_alert = on_alert
        self._events: list[Event] = []
        self._cleared = -1

    @property
    def actions(self) -> frozenset[Action]:
        """Every action some rule may take (the Tap checks e.g. that ``rollback`` has a Rollback)."""
        return frozenset(a for r in self.rules for a in r.actions)

    @property
    def cleared_through(self) -> int:
        """Highest step such that every record up to it has been processed and no rule decided to
        stop, raise or roll back on any of them (-1 before any). Feed it to ``Rollback.confirm``.

        After a blocking decision at step ``d`` it stays below ``d`` for the rest of that
        :meth:`process` call; later calls advance it again (the training side discards snapshots
        taken before it acted on the decision, so clearing later records is safe).
        """
        return self._cleared

    def process(self, records: Sequence[Record]) -> list[Decision]:
        """Run every rule over ``records`` (step order) and return the decisions, in step order.

        Also queues one anomaly event per decision, and a warning event per failing alert hook,
        for :meth:`take_events`.
        """
        decisions: list[Decision] = []
        blocked = False
        for record in records:
            step_decisions = self._process_one(record)
            decisions.extend(step_decisions)
            if any(d.blocking for d in step_decisions):
                blocked = True
            if not blocked:
                self._cleared = max(self._cleared, record.step)
        return decisions

    def _process_one(self, record: Record) -> list[Decision]:
        # Flags cover every rule (False where the metric is missing), so all ranks agree on
        # vectors of the same length even if their records differ.
        found: list[Anomaly | None] = [
            r.check(record, self.history) if r.applies_to(record) and record.step >= r.warmup else None
            for r in self.rules
        ]
        fired = [a is not None for a in found]
        if self._agree is not None and self.rules:
            fired = [bool(f) for f in self._agree(record.step, fired)]
        out: list[tuple[Rule, Decision]] = []
        for rule, anomaly, did_fire in zip(self.rules, found, fired):
            if rule.applies_to(record):
                rule.update(record, fired=did_fire)
            if not did_fire:
                continue
            if anomaly is None:  # another rank fired; this rank acts on the agreed decision
                anomaly = Anomaly(rule.metric, f"agreed across ranks (fired on another rank) at step {record.step}")
            out.append((rule, self._decide(rule, anomaly, record)))
        self.history.append(record)
        for rule, d in out:
            self._events.append(d.to_event())
            if d.wants(Action.ALERT):
                self._alert(d, rule_hook=rule.on_alert)
        return [d for _, d in out]

    def _decide(self, rule: Rule, anomaly: Anomaly, record: Record) -> Decision:
        metric = anomaly.metric
        recent = self.history[metric] + ((record.values[metric],) if metric in record.values else ())
        return Decision(
            step=record.step,
            rule=rule.name,
            metric=metric,
            actions=rule.actions,
            message=anomaly.message,
            value=anomaly.value,
            recent=recent[-self.history.maxlen :],
            run_id=record.run_id,
            rank=record.rank,
            epoch=record.epoch,
            batch=record.batch,
            wall_time=record.wall_time,
            batch_size=anomaly.batch_size,
            sampler=anomaly.sampler,
        )

    def _alert(self, decision: Decision, *, rule_hook: AlertHook | None) -> None:
        for hook in (rule_hook, self._on_alert):
            if hook is None:
                continue
            try:
                hook(decision)
            except Exception as exc:  # a user hook must not take the pipeline (and the run) down
                self._events.append(
                    Event(
                        run_id=decision.run_id,
                        step=decision.step,
                        kind=EventKind.WARNING,
                        message=f"alert hook {getattr(hook, '__name__', hook)!r} of {decision.rule} failed: "
                        f"{type(exc).__name__}: {exc}",
                        wall_time=decision.wall_time,
                        metric=decision.metric,
                        rank=decision.rank,
                    )
                )

    def take_events(self) -> list[Event]:
        """Return and forget the events queued since the last call (anomaly + warning events)."""
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Forget every rule's state and the history (e.g. after the training state was restored)."""
        for r in self.rules:
            r.reset()
        self.history.clear()
