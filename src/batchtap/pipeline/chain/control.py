"""What the pipeline tells the training thread, and the run's stop state: one object, one place.

The pipeline (a thread, or a process through its receiver thread) posts here; the training thread
reads here at step boundaries. Nothing else holds stop state or rule verdicts:

* ``local_stop``: this rank asked to stop (NaN guard, a stop rule, :meth:`Tap.request_stop`), with
  the step; in a process group not yet agreed with the other ranks.
* ``stop_reason``: the agreed stop (``Tap.should_stop`` is ``stop_reason is not None``).
* verdicts: the rules' decisions, in order, applied by the training thread (at its next step, or
  at the flush step the ranks agree on).
* the first pipeline failure, raised by the next ``step()``.
* the first value-revealed input error (a class index out of range), *held* until a deterministic
  step: blocks are numbered as the training thread hands them over (:meth:`Control.hand_block`),
  the pipeline reports each block judged with its input error (:meth:`Control.judged`), and at the
  hand-over of block ``n`` the training thread makes sure blocks ``0 .. n-1`` were judged and only
  then lets their first error be raised (by the next ``step()``). So an error found in the block of
  flush ``k`` is raised by the first ``step()`` after flush ``k + 1``, however far behind the
  pipeline (thread or process) was; a drain (``Tap.flush()``, the run's end) releases it at once.
* ``anomaly_counts``: the decoder's counts of values out of their domain, as a snapshot the
  pipeline hands over after each block that changed them (never an object it goes on mutating).

Posting appends to deques and sets attributes (atomic under the GIL). The training thread waits
here in one place only: :meth:`Control.hand_block`, when the pipeline has not judged the block
handed over one flush earlier (a pipeline a whole flush behind; the steady path is one integer
compare).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator, Mapping

from batchtap.rules.base import Decision

__all__ = ["JUDGE_WAIT", "Control", "Verdict"]

#: seconds a hand-over waits at most for the previous block's verdict. A pipeline that far behind
#: is stuck (a sink blocked with ``backpressure="block"``), and the full ring stops training soon
#: after anyway; past it the held error waits for a later hand-over rather than training for ever.
JUDGE_WAIT = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """The rules' decisions on one block, and how far the engine has cleared the records."""

    decisions: list[Decision]
    cleared_through: int


class Control:
    """See the module docstring."""

    def __init__(self) -> None:
        self._judging = threading.Condition()  # the pipeline's judged blocks, waited for at a hand-over
        self.reset()

    def reset(self) -> None:
        """Forget the last run's state (a new run starts)."""
        self.local_stop: tuple[str, int] | None = None
        self.stop_reason: str | None = None
        self._verdicts: collections.deque[Verdict] = collections.deque()
        self.applied = 0  # verdicts taken so far in this run
        self._error: BaseException | None = None
        self.anomaly_counts: Mapping[str, int] = {}
        # blocks of the current chain: handed over (training thread), judged (pipeline side), and
        # the first input error of a judged block, held until the hand-over that makes it due
        self._chain: int | None = None
        self._handed = 0
        self._judged = 0
        self._held: BaseException | None = None

    # ------------------------------------------------------------------ pipeline side

    def post(self, verdict: Verdict) -> None:
        self._verdicts.append(verdict)

    def count_anomalies(self, counts: Mapping[str, int]) -> None:
        """The run's anomaly counts so far (copied: the caller may go on counting in its own)."""
        self.anomaly_counts = dict(counts)

    def fail(self, error: BaseException) -> None:
        """Keep the first error for the training thread (later ones are logged where they happen).

        A failure is raised by the next ``step()`` whenever it comes (and ends any wait in
        :meth:`hand_block`: a failed pipeline may never judge the block waited for)."""
        with self._judging:
            if self._error is None:
                self._error = error
            self._judging.notify_all()

    def judged(self, chain: int, index: int, error: BaseException | None = None) -> None:
        """Block ``index`` of ``chain`` went through decode, validation and rules; ``error`` is the
        first input error its values revealed (held until :meth:`hand_block` makes it due).

        A block judged twice (resent to a restarted pipeline process) counts once; a block of an
        older chain (a run already ended) is ignored."""
        with self._judging:
            if chain != self._chain:
                return
            if error is not None and self._held is None:
                self._held = error
            self._judged = max(self._judged, index + 1)
            self._judging.notify_all()

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

    def hand_block(self, chain: int, *, wait: bool = True) -> int:
        """Training thread, at each block's hand-over: the block's index in ``chain`` (0, 1, ...).

        Before it returns, every earlier block of the chain was judged (waiting if the pipeline is
        a whole flush behind), and their first input error became due: the next ``step()`` raises
        it. Waiting ends early when the pipeline fails (its failure is raised instead). With
        ``wait=False`` (the device gate is paused: the pipeline cannot read rows meanwhile) only
        what was judged already becomes due.
        """
        if chain != self._chain:  # a run's first block (its chain was opened at its first step)
            with self._judging:
                self._chain, self._handed, self._judged, self._held = chain, 0, 0, None
        index = self._handed
        self._handed = index + 1
        if self._judged < index and wait:  # steady path: the pipeline judged the last block long ago
            with self._judging:
                # sync: backpressure — the pipeline has not judged the block handed over one flush
                # ago (device lag, a slow decode or blocked sinks); the error it may hold must be
                # due at this flush, whatever the pipeline's pace. No device query, no host read.
                self._judging.wait_for(lambda: self._judged >= index or self._error is not None, JUDGE_WAIT)
        self._release_held()
        return index

    def release_held(self) -> None:
        """Everything handed over was judged (a drain passed): its input error is due now."""
        self._release_held()

    def _release_held(self) -> None:
        if self._held is not None:
            with self._judging:
                held, self._held = self._held, None
                if held is not None and self._error is None:
                    self._error = held

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
