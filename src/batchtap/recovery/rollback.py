"""Automatic recovery: keep last-good snapshots of the training state and roll back to one on divergence.

Everything here runs on the **training thread** (it touches the model and optimizer), driven by the Tap:

1. ``maybe_snapshot(step)`` after every ``step()``: every ``every`` steps it clones the model,
   optimizer and scheduler state *on their device* (no host read, so no sync). The snapshot is
   *pending*: the rules have not yet seen the records of the steps it covers.
2. ``confirm(upto_step)`` when the rule engine has cleared every record up to ``upto_step``: pending
   snapshots taken *before* it become *good*. The parameters saved after step ``s`` are first judged
   by the loss of step ``s + 1`` (the loss of step ``s`` was computed before that update), so the
   snapshot of step ``s`` needs the record of ``s + 1`` cleared. Only the ``keep`` newest good
   snapshots are kept.
3. ``restore(decision)`` when a rule decided ``rollback`` on the record of step ``d``: loads the
   newest good snapshot of a step before ``d - 1`` (the parameters that produced the record of
   ``d`` are the ones saved after ``d - 1``), bit-exact, scales the learning rate by ``lr_factor`` per consecutive retry,
   asks the loop to skip the next ``skip_batches`` batches, and counts the retry. After
   ``max_retries`` consecutive retries without a newer snapshot being confirmed it raises
   :class:`~batchtap.errors.TrainingDiverged` (``on_exhausted="raise"``) or reports that training
   should stop (``on_exhausted="stop"``).

The state at construction is the first good snapshot (step ``-1``), so a divergence before the first
confirmed snapshot still has somewhere to go. Records of the abandoned trajectory keep arriving for a
step or two after a restore; decisions about them are *stale* (:meth:`Rollback.is_stale`) and ignored.

With ``where=<directory>`` a snapshot is cloned on the device when taken and written with
``torch.save`` when confirmed (that write copies device memory to the host: the one sync, paid once
per confirmed snapshot), so only pending snapshots occupy device memory.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections import deque
from pathlib import Path
from typing import Any, Literal, Protocol, Union

import torch

from batchtap._validate import require_int, require_number
from batchtap.errors import ConfigError, TrainingDiverged
from batchtap.rules.base import Decision

__all__ = ["OnExhausted", "Rollback", "RollbackResult", "Where"]

#: Where snapshots live: device memory, or a directory of ``torch.save`` files.
Where = Union[Literal["memory"], str, "os.PathLike[str]"]
#: What happens when ``max_retries`` consecutive rollbacks did not help.
OnExhausted = Literal["raise", "stop"]

# Param-group keys holding a learning rate that schedulers read back (OneCycleLR: max_lr;
# every scheduler: initial_lr). Scaling all of them keeps the lower lr after the scheduler's next step.
_LR_KEYS = ("lr", "initial_lr", "max_lr")


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RollbackResult:
    """What a rollback did.

    Attributes:
        retry: consecutive rollback count, 1-based (``> max_retries`` when ``exhausted``).
        diverged_step: the step the rollback decision was about.
        restored_step: step of the snapshot restored (``-1``: the state at construction).
        current_step: the training step at which it was restored.
        undone_steps: steps whose updates were discarded (``restored_step + 1 .. current_step``).
        lr_scale: factor applied to the snapshot's learning rates.
        lrs: the learning rate of each param group after scaling (``nan`` for a tensor lr, which
            is not read to avoid a sync).
        skip_next: batches the training loop must skip before the next step.
        exhausted: retries ran out with ``on_exhausted="stop"``: nothing was restored; stop training.
        reason: the rule's message that caused it.
    """

    retry: int
    diverged_step: int
    restored_step: int
    current_step: int
    undone_steps: range
    lr_scale: float
    lrs: tuple[float, ...]
    skip_next: int
    exhausted: bool = False
    reason: str = ""

    @property
    def message(self) -> str:
        """One line for the rollback event."""
        if self.exhausted:
            return (
                f"rollback retries exhausted ({self.retry - 1} consecutive) at step {self.diverged_step}: "
                f"{self.reason}; stopping"
            )
        undone = f"{self.undone_steps.start}..{self.undone_steps.stop - 1}" if self.undone_steps else "none"
        return (
            f"rollback {self.retry}: divergence at step {self.diverged_step} ({self.reason}); restored the "
            f"snapshot of step {self.restored_step} at step {self.current_step}, undone steps {undone}, "
            f"lr x{self.lr_scale:g}, skipping the next {self.skip_next} batches"
        )


@dataclasses.dataclass(slots=True)
class _Snapshot:
    step: int
    state: dict[str, Any] | None  # device clones; None once written to disk
    path: Path | None = None


class Rollback:
    """Last-good snapshots of model, optimizer and scheduler, and the rollback that restores them.

    Args:
        model: the module whose ``state_dict`` is saved (parameters and buffers).
        optimizer: its optimizer.
        scheduler: an lr scheduler, or ``None``.
        every: take a snapshot every ``every`` steps. Make it at least the Tap's flush interval:
            pending snapshots wait for the rules, and at most ``keep`` can wait at once.
        keep: good snapshots kept (and pending snapshots allowed).
        lr_factor: learning-rate multiplier per consecutive retry, in ``(0, 1]``.
        skip_batches: batches the loop skips after a restore (beyond the undone steps' batches,
            which are never replayed: the data stream is not rewound).
        max_retries: consecutive rollbacks allowed without a newer snapshot confirmed in between.
        where: ``"memory"`` (device clones) or a directory for ``torch.save`` files.
        on_exhausted: ``"raise"`` (TrainingDiverged) or ``"stop"`` once retries run out.

    Raises:
        ConfigError: ``every``/``keep``/``max_retries`` < 1, ``skip_batches`` < 0, ``lr_factor``
            not in ``(0, 1]``, an unknown ``on_exhausted``.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> rb = Rollback(model, opt, every=1, lr_factor=0.5)
        >>> before = {k: v.clone() for k, v in model.state_dict().items()}
        >>> _ = rb.maybe_snapshot(0)                                 # after step 0's update
        >>> _ = rb.confirm(1)                   # the rules cleared step 1, the first loss it produced
        >>> with torch.no_grad():
        ...     _ = model.weight.add_(float("nan"))                  # step 1's update diverges
        >>> d = Decision(step=2, rule="nonfinite(loss)", metric="loss", actions=(), message="loss is nan")
        >>> result = rb.restore(d, step=2)
        >>> result.restored_step, result.lrs, torch.equal(model.weight, before["weight"])
        (0, (0.05,), True)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None = None,
        *,
        every: int = 100,
        keep: int = 2,
        lr_factor: float = 0.5,
        skip_batches: int = 0,
        max_retries: int = 3,
        where: Where = "memory",
        on_exhausted: OnExhausted = "raise",
    ) -> None:
        name = "Rollback"
        for obj, arg in ((model, "model"), (optimizer, "optimizer"), (scheduler, "scheduler")):
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ConfigError(f"{name}: {arg} needs state_dict()/load_state_dict(), got {type(obj).__name__}.")
        require_int(name, "every", every, minimum=1)
        require_int(name, "keep", keep, minimum=1)
        require_int(name, "skip_batches", skip_batches, minimum=0)
        require_int(name, "max_retries", max_retries, minimum=1)
        self.lr_factor = require_number(name, "lr_factor", lr_factor, above=0.0)
        if self.lr_factor > 1.0:
            raise ConfigError(
                f"{name}: lr_factor must be in (0, 1], got {lr_factor}; a rollback lowers the learning rate. "
                "Fix: e.g. lr_factor=0.5."
            )
        if on_exhausted not in ("raise", "stop"):
            raise ConfigError(f"{name}: on_exhausted must be 'raise' or 'stop', got {on_exhausted!r}.")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.every = every
        self.keep = keep
        self.skip_batches = skip_batches
        self.max_retries = max_retries
        self.on_exhausted: OnExhausted = on_exhausted
        self.directory: Path | None = None if where == "memory" else Path(where)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._good: deque[_Snapshot] = deque()
        self._pending: deque[_Snapshot] = deque()
        self._retries = 0
        self._restored_through: int | None = None  # training step of the last restore
        self._last_step = -1
        self._skip_left = 0
        self.results: list[RollbackResult] = []  #: every rollback so far, oldest first
        self._add_good(self._capture(-1))

    # ---- state -------------------------------------------------------------------------------

    @property
    def retries(self) -> int:
        """Consecutive rollbacks since a snapshot newer than the last restore was confirmed."""
        return self._retries

    @property
    def good_steps(self) -> tuple[int, ...]:
        """Steps of the good snapshots, oldest first."""
        return tuple(s.step for s in self._good)

    @property
    def pending_steps(self) -> tuple[int, ...]:
        """Steps of the snapshots waiting for the rules, oldest first."""
        return tuple(s.step for s in self._pending)

    @property
    def skip_left(self) -> int:
        """Batches the loop must still skip after the last restore."""
        return self._skip_left

    def is_stale(self, step: int) -> bool:
        """Whether ``step`` belongs to a trajectory a restore already abandoned (its decisions are moot)."""
        return self._restored_through is not None and step <= self._restored_through

    # ---- the three calls ---------------------------------------------------------------------

    def maybe_snapshot(self, step: int) -> bool:
        """Call after every training step: every ``every`` steps take a pending snapshot.

        Returns whether a snapshot was taken. None is taken while ``keep`` snapshots are already
        pending (the rules lag behind; memory stays bounded).
        """
        self._last_step = max(self._last_step, step)
        if step % self.every != 0 or len(self._pending) >= self.keep:
            return False
        self._pending.append(self._capture(step))
        return True

    def confirm(self, upto_step: int) -> int:
        """The rules cleared every step ``<= upto_step``: pending snapshots of steps before it become good.

        (The snapshot of step ``s`` holds the parameters whose first loss is the record of ``s + 1``.)

        Returns how many were promoted.
        """
        n = 0
        while self._pending and self._pending[0].step < upto_step:
            snap = self._pending.popleft()
            if self._restored_through is not None and snap.step > self._restored_through:
                self._retries = 0  # a state newer than the last restore proved good: progress
            self._add_good(snap)
            n += 1
        return n

    def restore(self, decision: Decision, *, step: int | None = None) -> RollbackResult | None:
        """Roll back for ``decision``: restore the newest good snapshot of a step before ``decision.step - 1``.

        Args:
            decision: the rule decision asking for it.
            step: the current training step (default: the last one given to :meth:`maybe_snapshot`).
                Decisions about steps up to it are stale after this restore.

        Returns:
            What was done, or ``None`` if the decision is stale (nothing done).

        Raises:
            TrainingDiverged: retries exhausted with ``on_exhausted="raise"``, or no good snapshot.
        """
        if self.is_stale(decision.step):
            return None
        current = self._last_step if step is None else step
        if self._retries >= self.max_retries:
            if self.on_exhausted == "raise":
                raise TrainingDiverged(
                    f"training diverged at step {decision.step} ({decision.rule}: {decision.message}) and "
                    f"{self._retries} consecutive rollbacks did not help (max_retries={self.max_retries})",
                    step=decision.step,
                    metric=decision.metric,
                    recent=decision.recent,
                )
            result = RollbackResult(
                retry=self._retries + 1,
                diverged_step=decision.step,
                restored_step=-1,
                current_step=current,
                undone_steps=range(0),
                lr_scale=1.0,
                lrs=(),
                skip_next=0,
                exhausted=True,
                reason=decision.message,
            )
            self.results.append(result)
            return result
        # Rules run in step order, so a decision at step d means every step before d was cleared.
        self.confirm(decision.step - 1)
        # The snapshot of step d - 1 produced the flagged record of step d: not good after all.
        while self._good and self._good[-1].step >= decision.step - 1:
            self._drop(self._good.pop())
        if not self._good:
            raise TrainingDiverged(
                f"training diverged at step {decision.step} ({decision.message}) and no good snapshot precedes it",
                step=decision.step,
                metric=decision.metric,
                recent=decision.recent,
            )
        for snap in self._pending:  # taken on the trajectory being abandoned
            self._drop(snap)
        self._pending.clear()
        target = self._good[-1]
        self._retries += 1
        scale = self.lr_factor**self._retries
        self._load(target)
        lrs = self._scale_lr(scale)
        self._restored_through = max(current, decision.step)
        self._skip_left = self.skip_batches
        result = RollbackResult(
            retry=self._retries,
            diverged_step=decision.step,
            restored_step=target.step,
            current_step=current,
            undone_steps=range(target.step + 1, current + 1),
            lr_scale=scale,
            lrs=lrs,
            skip_next=self.skip_batches,
            reason=decision.message,
        )
        self.results.append(result)
        return result

    def should_skip(self) -> bool:
        """Call for each batch the loop fetches: True while batches must be skipped after a restore."""
        if self._skip_left <= 0:
            return False
        self._skip_left -= 1
        return True

    # ---- internals ---------------------------------------------------------------------------

    def _capture(self, step: int) -> _Snapshot:
        state: dict[str, Any] = {
            "model": _clone(self.model.state_dict()),
            "optimizer": _clone(self.optimizer.state_dict()),
        }
        if self.scheduler is not None:
            state["scheduler"] = _clone(self.scheduler.state_dict())
        return _Snapshot(step=step, state=state)

    def _add_good(self, snap: _Snapshot) -> None:
        if self.directory is not None and snap.path is None:
            snap.path = self.directory / f"rollback-step{snap.step}.pt"
            # sync: torch.save copies device tensors to the host; paid once per confirmed snapshot,
            # which is the point of where=<directory> (device memory holds pending snapshots only).
            torch.save(snap.state, snap.path)
            snap.state = None
        self._good.append(snap)
        while len(self._good) > self.keep:
            self._drop(self._good.popleft())

    def _drop(self, snap: _Snapshot) -> None:
        snap.state = None
        if snap.path is not None:
            snap.path.unlink(missing_ok=True)

    def _load(self, snap: _Snapshot) -> None:
        if snap.state is not None:
            # A fresh clone: optimizer.load_state_dict keeps tensors that already match the param's
            # device and dtype, and the optimizer then updates them in place -- that must not
            # corrupt the snapshot a later retry restores again.
            state = _clone(snap.state)
        else:
            assert snap.path is not None
            # weights_only=False: scheduler states may hold plain Python objects; the file is our own.
            state = torch.load(snap.path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def _scale_lr(self, scale: float) -> tuple[float, ...]:
        lrs: list[float] = []
        for group in self.optimizer.param_groups:
            for key in _LR_KEYS:
                if key not in group:
                    continue
                if isinstance(group[key], torch.Tensor):
                    group[key].mul_(scale)  # in place on the device: no host read
                else:
                    group[key] = group[key] * scale
            lr = group.get("lr")
            lrs.append(float(lr) if isinstance(lr, (int, float)) else float("nan"))
        if self.scheduler is not None:
            for attr in ("base_lrs", "_last_lr"):
                values = getattr(self.scheduler, attr, None)
                if isinstance(values, list):
                    setattr(self.scheduler, attr, [v * scale for v in values])
        return tuple(lrs)


def _clone(obj: Any) -> Any:
    """Deep copy with tensors cloned where they live (``Tensor.clone`` on a GPU is an async kernel)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        out = {k: _clone(v) for k, v in obj.items()}
        if type(obj) is dict:
            return out
        copied = type(obj)(out)  # an OrderedDict state_dict...
        if hasattr(obj, "_metadata"):  # ...carries module versions load_state_dict reads back
            copied._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
        return copied
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    return copy.deepcopy(obj)
