"""Rows and runs-table summaries of runs that have ended, read once and kept between requests.

A run's step count, last step and last wall time are aggregates over every value it stored, and
its runs-table summary (count, best, last of the main metric on the kept trajectory) another pass
over the main metric: listing the runs of a 2 GB SQLite store (four runs of 10^6 steps, six
metrics) took about 14 s on the shared 2-core machine, and the runs page, every live runs-table
stream and every run page asked for it again. A run that has ended stores no more values, so its
row and summary are kept, keyed by a fingerprint of what can still change about it: its row in the
runs table (status, end, stop reason, environment with tags and notes, declared names) and its
event count. A resumed run is running again (its fingerprint moves), and a run that is running is
read again on every request. Requests that want the same run at the same time wait for one read
(a lock per run) instead of each scanning the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from batchtap.store.rows import RunRow

__all__ = ["EndedRuns"]


class EndedRuns:
    """Kept ``(row, summary)`` pairs of ended runs, by run id.

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

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._kept: dict[str, tuple[Hashable, RunRow, dict[str, Any]]] = {}

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
            kept = self._kept.get(run_id)
            if kept is not None and kept[0] == fingerprint:
                return kept[1], kept[2]
            row, summary = read(run_id)
            if ended:
                self._kept[run_id] = (fingerprint, row, summary)
            else:
                self._kept.pop(run_id, None)
            return row, summary

    def summary_of(self, row: RunRow) -> dict[str, Any] | None:
        """The kept summary made with this very row (``None`` when it is not the kept one)."""
        kept = self._kept.get(row.id)
        return kept[2] if kept is not None and kept[1] is row else None

    def forget(self, keep: set[str]) -> None:
        """Drop what is kept of runs not in ``keep`` (deleted from the store)."""
        with self._guard:
            for run_id in [r for r in self._kept if r not in keep]:
                self._kept.pop(run_id, None)
                self._locks.pop(run_id, None)
