"""What every rule shares: actions, the anomaly a rule reports, the decision it leads to, the history it
may read, the base class.

A rule watches decoded host :class:`~batchtap.records.Record` s in step order. It is split in two so
that several ranks can agree on a decision before anyone's state moves on:

* :meth:`Rule.check` reads the rule's state and one record and says whether it fires. It changes
  nothing, so it can be called, its answer exchanged with other ranks, and the agreed answer used.
* :meth:`Rule.update` folds the record into the state, told whether the (agreed) decision fired, so
  counters and cool-downs reset identically everywhere.

Rules never see tensors and never act themselves: they name :class:`Action` s, which the
:class:`~batchtap.rules.engine.RuleEngine` turns into :class:`Decision` s and the training thread applies
(:mod:`batchtap.recovery`). ``Decision`` lives here, not with the engine, because the alert hooks a
rule takes are typed by it: the engine imports this module, never the other way round.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import fnmatch
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Literal, Protocol, Union, runtime_checkable

from batchtap._validate import require_int
from batchtap.errors import ConfigError, TrainingDiverged
from batchtap.records import Event, EventKind, Record

__all__ = [
    "Action",
    "ActionName",
    "ActionsArg",
    "AlertHook",
    "Anomaly",
    "BatchSizeTarget",
    "CallableRule",
    "Decision",
    "History",
    "MetricGlob",
    "Rule",
    "RuleFn",
    "is_glob",
    "parse_actions",
]


class Action(str, enum.Enum):
    """What the training side does when a rule fires.

    A rule names one or more; they are applied in this order: ``alert`` (already done on the pipeline
    thread), ``batch_size``, ``rollback``, ``stop``, ``raise``.
    """

    ALERT = "alert"  #: store an anomaly event (every sink, the console) and call the alert hook
    BATCH_SIZE = "batch_size"  #: set the batch size a rule computed on an adaptive sampler
    ROLLBACK = "rollback"  #: restore the last good snapshot, scale the lr, skip batches
    STOP = "stop"  #: ``tap.should_stop`` turns True; the run ends as stopped with the reason
    RAISE = "raise"  #: raise :class:`~batchtap.errors.TrainingDiverged` on the training thread


#: An action spelled as a string.
ActionName = Literal["alert", "batch_size", "rollback", "stop", "raise"]
#: What a rule's ``action=`` argument accepts: one action or several.
ActionsArg = Union[Action, ActionName, Sequence[Action | ActionName]]
#: A user callable run on the pipeline thread when a rule with the ``alert`` action fires.
AlertHook = Callable[["Decision"], object]


def parse_actions(action: ActionsArg, *, rule: str) -> tuple[Action, ...]:
    """Normalise a rule's ``action=`` argument to a tuple of :class:`Action` without duplicates.

    Raises:
        ConfigError: an unknown action name, or no action at all.

    Example:
        >>> parse_actions("stop", rule="nonfinite")
        (<Action.STOP: 'stop'>,)
        >>> [a.value for a in parse_actions(["alert", Action.ROLLBACK], rule="spike")]
        ['alert', 'rollback']
    """
    items: Iterable[object] = (action,) if isinstance(action, str) else action
    out: list[Action] = []
    for item in items:
        try:
            parsed = Action(item)
        except ValueError:
            known = ", ".join(repr(a.value) for a in Action)
            raise ConfigError(
                f"{rule}: unknown action {item!r}; expected one of {known}. "
                "Fix: pass action= one of those names (or a sequence of them)."
            ) from None
        if parsed not in out:
            out.append(parsed)
    if not out:
        raise ConfigError(f"{rule}: action= is empty; expected at least one action. Fix: e.g. action='alert'.")
    return tuple(out)


@runtime_checkable
class BatchSizeTarget(Protocol):
    """Something whose batch size a rule can set (an :class:`~batchtap.recovery.sampler.AdaptiveBatchSampler`)."""

    @property
    def batch_size(self) -> int:
        """The size the next batch will have."""
        ...

    def set_batch_size(self, n: int) -> int:
        """Set the size of the next batch, clamped to the target's bounds; return the size applied."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Anomaly:
    """What a rule reports when it fires on a record.

    Attributes:
        metric: the metric that triggered it.
        message: what was expected and what arrived, e.g. ``"loss 9.1 > 3 x EMA 1.02"``.
        value: the value that triggered it (``nan`` for a rule without a single value).
        batch_size: for the ``batch_size`` action, the size the sampler should take next.
        sampler: for the ``batch_size`` action, the sampler to resize.

    Example:
        >>> Anomaly("loss", "loss is nan", float("nan")).metric
        'loss'
    """

    metric: str
    message: str
    value: float = math.nan
    batch_size: int | None = None
    sampler: BatchSizeTarget | None = dataclasses.field(default=None, compare=False, repr=False)


# Actions that end or rewind the current trajectory: a snapshot is only "good" before them.
_BLOCKING = frozenset({Action.ROLLBACK, Action.STOP, Action.RAISE})


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """One rule fired on one record: what to do, where, and why.

    Attributes:
        step: global step of the record that triggered it.
        rule: the rule's name, e.g. ``"spike(loss)"``.
        metric: the metric concerned.
        actions: what the training side should do, in the order it applies them.
        message: what was expected and what arrived.
        value: the triggering value.
        recent: the metric's most recent values up to and including this one, oldest first.
        run_id: the record's run.
        rank: the record's rank.
        epoch: the record's epoch.
        batch: the record's batch index within its epoch.
        wall_time: the record's wall time.
        batch_size: for ``batch_size``: the size the sampler should take.
        sampler: for ``batch_size``: the sampler to resize.

    Example:
        >>> d = Decision(step=5, rule="nonfinite(loss)", metric="loss", actions=(Action.STOP,),
        ...              message="loss is nan", value=float("nan"), recent=(0.7, float("nan")))
        >>> d.to_event().kind.value, d.wants(Action.STOP)
        ('anomaly', True)
    """

    step: int
    rule: str
    metric: str
    actions: tuple[Action, ...]
    message: str
    value: float = math.nan
    recent: tuple[float, ...] = ()
    run_id: str = ""
    rank: int = 0
    epoch: int = 0
    batch: int = 0
    wall_time: float = 0.0
    batch_size: int | None = None
    sampler: BatchSizeTarget | None = dataclasses.field(default=None, compare=False, repr=False)

    def wants(self, action: Action) -> bool:
        """Whether this decision includes ``action``."""
        return action in self.actions

    @property
    def blocking(self) -> bool:
        """Whether it stops, raises or rolls back (the trajectory up to it cannot be trusted)."""
        return any(a in _BLOCKING for a in self.actions)

    def to_event(self) -> Event:
        """The anomaly event to store for this decision (every sink, the console)."""
        acts = ", ".join(a.value for a in self.actions)
        return Event(
            run_id=self.run_id,
            step=self.step,
            kind=EventKind.ANOMALY,
            message=f"{self.rule}: {self.message} -> {acts}",
            wall_time=self.wall_time,
            metric=self.metric,
            raw_value=self.value,
            rank=self.rank,
        )

    def to_error(self) -> TrainingDiverged:
        """The exception the ``raise`` action raises."""
        return TrainingDiverged(
            f"training diverged at step {self.step}: {self.rule}: {self.message}",
            step=self.step,
            metric=self.metric,
            recent=self.recent,
        )


class History:
    """The recent past a rule can read: the last ``maxlen`` values of every metric, oldest first.

    The engine shows a rule the history *before* the record being checked; the record itself is
    passed separately. A metric never seen reads as an empty tuple.

    Example:
        >>> h = History(maxlen=2)
        >>> for step, loss in enumerate([1.0, 2.0, 3.0]):
        ...     h.append(Record("r", step=step, epoch=0, batch=step, rank=0, wall_time=0.0, values={"loss": loss}))
        >>> h["loss"], h.last_step
        ((2.0, 3.0), 2)
    """

    def __init__(self, maxlen: int = 256) -> None:
        if maxlen < 1:
            raise ConfigError(f"History maxlen must be >= 1, got {maxlen}. Fix: pass a positive window.")
        self._maxlen = maxlen
        self._values: dict[str, deque[float]] = {}
        self._steps: deque[int] = deque(maxlen=maxlen)

    @property
    def maxlen(self) -> int:
        """How many values per metric are kept."""
        return self._maxlen

    @property
    def last_step(self) -> int | None:
        """Step of the newest record appended, or ``None`` before the first."""
        return self._steps[-1] if self._steps else None

    def __getitem__(self, metric: str) -> tuple[float, ...]:
        return tuple(self._values.get(metric, ()))

    def __contains__(self, metric: object) -> bool:
        return metric in self._values

    def append(self, record: Record) -> None:
        """Add one record's values (called by the engine after every rule has seen the record)."""
        self._steps.append(record.step)
        for name, value in record.values.items():
            buf = self._values.get(name)
            if buf is None:
                buf = self._values[name] = deque(maxlen=self._maxlen)
            buf.append(value)

    def clear(self) -> None:
        """Forget everything."""
        self._values.clear()
        self._steps.clear()


class Rule(abc.ABC):
    """Base class of every rule: names, actions, warm-up, and the check/update split.

    Subclasses implement :meth:`check` (pure) and :meth:`update` (state), and may override
    :meth:`reset`. A rule whose metric is missing from a record neither checks nor updates on it.

    Args:
        name: a short label used in events, e.g. ``"spike(loss)"``.
        metric: the metric the rule watches.
        action: what to do when it fires: one :class:`Action` (or its name) or several.
        warmup: the rule does not fire on records with ``step < warmup`` (it still learns from them).
        on_alert: called on the pipeline thread with the decision when the rule fires with ``alert``.

    Example:
        >>> class Above(Rule):
        ...     def check(self, record, history):
        ...         v = record.values[self.metric]
        ...         return Anomaly(self.metric, f"{v} > 1", v) if v > 1 else None
        ...     def update(self, record, *, fired):
        ...         pass
        >>> rule = Above(name="above", metric="loss", action="stop")
        >>> rule.actions
        (<Action.STOP: 'stop'>,)
    """

    def __init__(
        self,
        *,
        name: str,
        metric: str,
        action: ActionsArg,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
    ) -> None:
        if not metric:
            raise ConfigError(f"{name}: metric must be a non-empty name, got {metric!r}. Fix: e.g. metric='loss'.")
        require_int(name, "warmup", warmup, minimum=0)
        if on_alert is not None and not callable(on_alert):
            raise ConfigError(f"{name}: on_alert must be callable, got {type(on_alert).__name__}.")
        self.name = name
        self.metric = metric
        self.actions = parse_actions(action, rule=name)
        self.warmup = warmup
        self.on_alert = on_alert

    #: whether the rule can run in a pipeline process (``Tap(pipeline="process")``): False for a
    #: rule that reads training-side objects while it decides (an adaptive sampler's batch size)
    runs_in_pipeline_process: ClassVar[bool] = True

    @property
    def handles_nonfinite_loss(self) -> bool:
        """Whether this rule decides what a non-finite loss does (the NaN guard then only hands
        the row to the rules at once instead of stopping by itself)."""
        return False

    def applies_to(self, record: Record) -> bool:
        """Whether the record carries this rule's metric (a rule skips records that do not)."""
        return self.metric in record.values

    @abc.abstractmethod
    def check(self, record: Record, history: History) -> Anomaly | None:
        """Decide whether the rule fires on ``record``, from the state before it. Must not change state."""

    @abc.abstractmethod
    def update(self, record: Record, *, fired: bool) -> None:
        """Fold ``record`` into the state; ``fired`` is the agreed decision for this record."""

    def reset(self) -> None:  # noqa: B027 - stateless rules need no reset
        """Forget all state (the engine calls it on :meth:`RuleEngine.reset`)."""

    def __repr__(self) -> str:
        acts = ",".join(a.value for a in self.actions)
        return f"<{type(self).__name__} {self.name} -> {acts}>"


#: A rule written as a function: ``(record, history) -> Anomaly | None``.
RuleFn = Callable[[Record, History], Anomaly | None]


class CallableRule(Rule):
    """Wrap a function ``(record, history) -> Anomaly | None`` as a stateless rule.

    The function sees every record (whatever metrics it carries) and the history before it.

    Example:
        >>> def too_slow(record, history):
        ...     t = record.values.get("step_time", 0.0)
        ...     return Anomaly("step_time", f"step took {t}s > 1s", t) if t > 1.0 else None
        >>> rule = CallableRule(too_slow, action="alert")
        >>> rule.name
        'too_slow'
    """

    def __init__(
        self,
        fn: RuleFn,
        *,
        action: ActionsArg = Action.ALERT,
        name: str | None = None,
        warmup: int = 0,
        on_alert: AlertHook | None = None,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"a rule must be a Rule or a callable (record, history) -> Anomaly | None, got {fn!r}.")
        label = name or getattr(fn, "__name__", None) or type(fn).__name__
        # The metric is only a label here: the function reads whatever it wants from the record.
        super().__init__(name=label, metric="*", action=action, warmup=warmup, on_alert=on_alert)
        self.fn = fn

    def applies_to(self, record: Record) -> bool:
        return True

    def check(self, record: Record, history: History) -> Anomaly | None:
        result = self.fn(record, history)
        if result is not None and not isinstance(result, Anomaly):
            raise TypeError(f"rule {self.name} returned {type(result).__name__}; expected Anomaly or None")
        return result

    def update(self, record: Record, *, fired: bool) -> None:
        pass


def is_glob(metric: str) -> bool:
    """Whether a rule's ``metric`` is a glob of metric names (``*``, ``?`` or ``[...]``), e.g.
    ``"grad_norm/*"`` for every layer's gradient norm.

    Example:
        >>> is_glob("grad_norm/*"), is_glob("loss")
        (True, False)
    """
    return any(c in metric for c in "*?[")


class MetricGlob(Rule):
    """One rule over every metric whose name matches a glob: a copy of the rule per matched name,
    each with its own state (its own EMA, streak, ...), made when the name is first seen.

    Built by the rules that accept a glob (``Spike("grad_norm/*")``, ``Threshold("update_ratio/*",
    above=0.1)``, ``NonFinite("grad_norm/*")``): they return one of these when given a glob. A
    record on which several names fire gives one decision, on the first of them in the record's
    order, whose message names the others; each copy that fired is told so.

    Example:
        >>> from batchtap.rules.builtin import Threshold
        >>> rule = Threshold("grad_norm/*", above=10.0)
        >>> rule.name, type(rule).__name__
        ('threshold(grad_norm/*>10.0)', 'MetricGlob')
        >>> r = Record("r", step=3, epoch=0, batch=3, rank=0, wall_time=0.0,
        ...            values={"loss": 1.0, "grad_norm/encoder": 2.0, "grad_norm/head": 42.0})
        >>> rule.check(r, History()).message
        'grad_norm/head 42 > 10.0 at step 3'
    """

    def __init__(self, kind: type[Rule], pattern: str, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        template = object.__new__(kind)
        init: Any = kind.__init__  # a rule's own signature (metric first), not Rule's keyword-only one
        init(template, pattern, *args, **kwargs)  # validates the arguments now
        super().__init__(
            name=template.name,
            metric=pattern,
            action=template.actions,
            warmup=template.warmup,
            on_alert=template.on_alert,
        )
        self.kind = kind
        self.args = args
        self.kwargs = {k: v for k, v in kwargs.items() if k != "name"}
        self._matches: dict[str, bool] = {}
        self._children: dict[str, Rule] = {}
        self._fired: tuple[str, ...] = ()  # the names that fired at the last check

    def _match(self, name: str) -> bool:
        hit = self._matches.get(name)
        if hit is None:
            if len(self._matches) > 65536:  # names that come and go (a per-step extra): bounded
                self._matches.clear()
            hit = self._matches[name] = fnmatch.fnmatchcase(name, self.metric)
        return hit

    def matched(self, record: Record) -> list[str]:
        """The record's metric names this rule watches, in the record's order."""
        return [name for name in record.values if self._match(name)]

    def _child(self, name: str) -> Rule:
        child = self._children.get(name)
        if child is None:
            child = object.__new__(self.kind)
            init: Any = self.kind.__init__
            init(child, name, *self.args, **self.kwargs)
            self._children[name] = child
        return child

    def applies_to(self, record: Record) -> bool:
        return any(self._match(name) for name in record.values)

    def check(self, record: Record, history: History) -> Anomaly | None:
        found: list[Anomaly] = []
        for name in self.matched(record):
            child = self._child(name)
            anomaly = child.check(record, history)
            if anomaly is not None:
                found.append(anomaly)
        self._fired = tuple(a.metric for a in found)
        if not found:
            return None
        first = found[0]
        if len(found) == 1:
            return first
        others = ", ".join(a.metric for a in found[1:])
        return dataclasses.replace(first, message=f"{first.message} (also {others})")

    def update(self, record: Record, *, fired: bool) -> None:
        fired_names = set(self._fired) if fired else set()
        self._fired = ()
        for name in self.matched(record):
            self._child(name).update(record, fired=name in fired_names)

    def reset(self) -> None:
        for child in self._children.values():
            child.reset()
        self._fired = ()


class GlobbedRule(Rule):
    """A rule whose ``metric`` (its first argument) may be a glob: given one, the constructor
    returns a :class:`MetricGlob` that keeps one copy of the rule per matched metric name."""

    def __new__(cls, metric: object = None, *args: object, **kwargs: object) -> Rule:  # type: ignore[misc]
        if isinstance(metric, str) and is_glob(metric):
            return MetricGlob(cls, metric, args, kwargs)
        return super().__new__(cls)
