"""Rows and runs-table summaries of runs that have ended, read once and kept between requests.

A run's step count, last step and last wall time are aggregates over every value it stored, and
its runs-table summary (count, best, last of the main metric on the kept trajectory) another pass
over the main metric: listing the runs of a 2 GB SQLite store (four runs of 10^6 steps, six
metrics) took about 14 s on the shared 2-core machine, and the runs page, every live runs-table
stream and every run page asked for it again. A run that has ended stores no more values, so its
row and summary are kept, keyed by a fingerprint of what can still change about it: its row in the
runs table (status, end, stop reason, environment with tags and notes, declared names) and its
event count. A resumed run is running again (its fingerprint moves), and a run that is running is
read again on every request (incrementally: :mod:`batchtap.ui.running`). Requests that want the
same run at the same time wait for one read (a lock per run) instead of each scanning the store.

What is kept is bounded by a byte budget (:data:`ENDED_BYTES`, ``ReadOnlyStore(ended_bytes=)``): each
entry is counted as its summary's JSON length x 3 + 2 KiB (Python objects take about that; the row
shares the summary's config and environment), and past the budget the least recently used runs are
dropped (read again when asked for). No values are kept: a run's row and summary are a few KiB
whatever its length.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable, Hashable
from typing import Any

from batchtap.store.rows import RunRow

__all__ = ["EndedRuns", "ENDED_BYTES", "entry_bytes"]

#: Bytes of rows and summaries kept, all ended runs together (see the module's text).
ENDED_BYTES = 64 << 20


def entry_bytes(summary: dict[str, Any]) -> int:
    """What one kept run is counted as: its summary's JSON length x 3 + 2 KiB.

    Example:
        >>> entry_bytes({"id": "a"})
        2081
    """
    return 3 * len(json.dumps(summary, default=str)) + 2048


class EndedRuns:
    """Kept ``(row, summary)`` pairs of ended runs, by run id, least recently used dropped first
    past ``budget`` bytes (:func:`entry_bytes`; the newest entry is kept even when it alone is larger).

    Example:
        >>> kept, reads = EndedRuns(), []
        >>> def read(run_id):
        ...     reads.append(run_id)
        ...     return f"row of {run_id}", {"id": run_id}
        >>> kept.get("a", ("finished", 1.0), ended=True, read=read)
        ('row of a', {'id': 'a'})
        >>> kept.get("a", ("finished", 1.0), ended=True, read=read) and reads  # kept: not read again
        ['a']
        >>> _ = kept.get("a", ("finished", 2.0), ended=True, read=read); reads  # it moved: read again
        ['a', 'a']
        >>> _ = kept.get("b", ("running",), ended=False, read=read); "b" in kept
        False
    """

    def __init__(self, budget: int = ENDED_BYTES) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._kept: collections.OrderedDict[str, tuple[Hashable, RunRow, dict[str, Any], int]] = (
            collections.OrderedDict()
        )
        self.budget = budget
        #: bytes counted for what is kept now, and how many entries the budget dropped so far.
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._kept

    def get(
        self,
        run_id: str,
        fingerprint: Hashable,
        *,
        ended: bool,
        read: Callable[[str], tuple[RunRow, dict[str, Any]]],
    ) -> tuple[RunRow, dict[str, Any]]:
        """The run's row and summary: kept ones when the fingerprint is unchanged, else
        ``read(run_id)`` (kept when the run has ended)."""
        with self._guard:
            lock = self._locks.setdefault(run_id, threading.Lock())
        with lock:  # one read per run at a time: a second request waits for it, then finds it kept
            with self._guard:
                kept = self._kept.get(run_id)
                if kept is not None and kept[0] == fingerprint:
                    self._kept.move_to_end(run_id)
                    return kept[1], kept[2]
            row, summary = read(run_id)
            with self._guard:
                self._drop(run_id)
                if ended:
                    size = entry_bytes(summary)
                    self._kept[run_id] = (fingerprint, row, summary, size)
                    self.bytes += size
                    while self.bytes > self.budget and len(self._kept) > 1:
                        oldest = next(iter(self._kept))
                        self._drop(oldest)
                        self._locks.pop(oldest, None)
                        self.evicted += 1
            return row, summary

    def _drop(self, run_id: str) -> None:
        gone = self._kept.pop(run_id, None)
        if gone is not None:
            self.bytes -= gone[3]

    def summary_of(self, row: RunRow) -> dict[str, Any] | None:
        """The kept summary made with this very row (``None`` when it is not the kept one)."""
        kept = self._kept.get(row.id)
        return kept[2] if kept is not None and kept[1] is row else None

    def forget(self, keep: set[str]) -> None:
        """Drop what is kept of runs not in ``keep`` (deleted from the store)."""
        with self._guard:
            for run_id in [r for r in self._kept if r not in keep]:
                self._drop(run_id)
                self._locks.pop(run_id, None)
