"""What the pipeline tells the training thread, and the run's stop state: one object, one place.

The pipeline (a thread, or a process through its receiver thread) posts here; the training thread
reads here at step boundaries. Nothing else holds stop state or rule verdicts:

* ``local_stop``: this rank asked to stop (NaN guard, a stop rule, :meth:`Tap.request_stop`), with
  the step; in a process group not yet agreed with the other ranks.
* ``stop_reason``: the agreed stop (``Tap.should_stop`` is ``stop_reason is not None``).
* verdicts: the rules' decisions, in order, applied by the training thread (at its next step, or
  at the flush step the ranks agree on).
* the first pipeline failure or value-revealed input error, raised by the next ``step()``.
* ``anomaly_counts``: the decoder's counts of values out of their domain, as a snapshot the
  pipeline hands over after each block that changed them (never an object it goes on mutating).

Posting appends to deques and sets attributes (atomic under the GIL); the training thread never
waits here.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator, Mapping

from batchtap.rules.base import Decision

__all__ = ["Control", "Verdict"]


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The rules' decisions on one block, and how far the engine has cleared the records."""

    decisions: list[Decision]
    cleared_through: int


class Control:
    """See the module docstring."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the last run's state (a new run starts)."""
        self.local_stop: tuple[str, int] | None = None
        self.stop_reason: str | None = None
        self._verdicts: collections.deque[Verdict] = collections.deque()
        self.applied = 0  # verdicts taken so far in this run
        self._error: BaseException | None = None
        self.anomaly_counts: Mapping[str, int] = {}

    # ------------------------------------------------------------------ pipeline side

    def post(self, verdict: Verdict) -> None:
        self._verdicts.append(verdict)

    def count_anomalies(self, counts: Mapping[str, int]) -> None:
        """The run's anomaly counts so far (copied: the caller may go on counting in its own)."""
        self.anomaly_counts = dict(counts)

    def fail(self, error: BaseException) -> None:
        """Keep the first error for the training thread (later ones are logged where they happen)."""
        if self._error is None:
            self._error = error

    # ------------------------------------------------------------------ training side

    @property
    def received(self) -> int:
        """Verdicts posted so far in this run (taken or waiting)."""
        return self.applied + len(self._verdicts)

    @property
    def waiting(self) -> int:
        return len(self._verdicts)

    def take_verdicts(self, count: int) -> Iterator[Verdict]:
        """The next ``count`` verdicts, oldest first."""
        for _ in range(count):
            verdict = self._verdicts.popleft()
            self.applied += 1
            yield verdict

    def take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    @property
    def has_error(self) -> bool:
        return self._error is not None

    def request_stop(self, reason: str, step: int) -> bool:
        """Record this rank's wish to stop; False when it had asked already (the first reason wins)."""
        if self.local_stop is not None:
            return False
        self.local_stop = (reason, step)
        return True

    def agree_stop(self, reason: str) -> None:
        """The ranks (or the one process) agreed to stop: ``should_stop`` turns True."""
        if self.stop_reason is None:
            self.stop_reason = reason
