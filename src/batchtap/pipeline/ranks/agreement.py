"""Rank agreement: every rank stops, and applies the same rule verdicts, at the same flush step.

At each flush step the training thread completes the exchange it issued one flush earlier and
issues the next one (``async_op=True`` on batchtap's own gloo group). The previous exchange has had
a whole flush interval to finish, so completing it normally returns at once: the training thread
does not wait for the slowest rank. Every rank acts on the same agreed values at the same step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from batchtap.errors import DistributedError
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.chain.reduce import new_group
from batchtap.pipeline.ranks import group as ranks

__all__ = ["RankAgreement", "ProcessGroups"]


@dataclasses.dataclass(slots=True)
class ProcessGroups:
    """batchtap's two gloo groups, made once per Tap (a collective on every rank, in order)."""

    agreement: Any  # training thread: stop agreement at flush steps, the shared run id
    reduce: Any  # pipeline: one exchange per flushed block

    @classmethod
    def create(cls, timeout: float) -> ProcessGroups:
        return cls(new_group(timeout), new_group(timeout))


class RankAgreement:
    """One run's agreement state on this rank.

    Args:
        groups: batchtap's gloo groups.
        timeout: seconds a collective may take (named in the error when it fails).
    """

    def __init__(self, groups: ProcessGroups, timeout: float) -> None:
        self.rank = ranks.rank()
        self.world_size = ranks.world_size()
        self.groups = groups
        self.timeout = timeout
        # two buffers, one in flight and one being read: [stop?, -lowest stopping rank, -verdicts received]
        self._buffers = torch.zeros((2, 3), dtype=torch.float64)
        self._views = self._buffers.numpy()  # read without a torch host read
        self._turn = 0
        self._pending: Any = None  # the exchange in flight, completed at the next flush

    def exchange(self, control: Control, step: int) -> int:
        """At a flush step: complete the last exchange, act on it, and issue the next.

        Sets ``control``'s agreed stop when some rank asked to stop, and returns how many rule
        verdicts every rank has received (and so applies now).

        Raises:
            DistributedError: a collective failed (a rank died or stalled).
        """
        agreed = 0
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                # sync: completes the CPU collective issued one flush ago (normally already done)
                pending.wait()
            except Exception as exc:
                raise self._failure(step, exc) from exc
            agreed = self._act(control, self._views[self._turn])
        self._turn ^= 1
        buf = self._views[self._turn]
        stop = control.local_stop is not None
        buf[0] = 1.0 if stop else 0.0
        buf[1] = -(self.rank if stop else self.world_size)  # MAX of -rank = lowest rank
        buf[2] = -control.received  # MAX of -count = the verdicts every rank has
        try:
            self._pending = dist.all_reduce(
                self._buffers[self._turn], op=dist.ReduceOp.MAX, group=self.groups.agreement, async_op=True
            )
        except Exception as exc:
            raise self._failure(step, exc) from exc
        return agreed

    def _act(self, control: Control, buf: Any) -> int:
        if buf[0] > 0:
            stopper = int(-buf[1])
            if control.local_stop is not None and stopper == self.rank:
                control.agree_stop(control.local_stop[0])
            else:
                control.agree_stop(f"rank {stopper} asked every rank to stop")
        return max(0, int(-buf[2]) - control.applied)

    def close(self) -> None:
        """End of run: complete the last exchange so every rank's groups stay in step."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                # sync: end of run — the last agreement completes (a failure was reported at its flush)
                pending.wait()
            except Exception:
                pass

    def _failure(self, step: int, exc: Exception) -> DistributedError:
        return DistributedError(
            f"rank {self.rank}: ranks could not agree at step {step}: "
            f"{ranks.describe_failure(exc, self.timeout)}; a rank probably died or "
            "stalled. Every step captured so far is being stored."
        )
