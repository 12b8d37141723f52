"""Sinks for tests of the pipeline process: they live in that process, so they leave what they
receive in a file the test reads back (pickles, appended one call at a time)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from pathlib import Path

from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.base import Sink
from tests.conftest import ListSink


class FileListSink(Sink):
    """Appends each call to ``path``; :func:`received` reads them back as a ListSink."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)

    def _put(self, *call: object) -> None:
        with open(self.path, "ab") as f:
            pickle.dump((os.getpid(), *call), f)

    def start_run(self, run: RunInfo) -> None:
        self._put("start_run", run)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self._put("write", list(records), list(events))

    def end_run(self, run: RunInfo) -> None:
        self._put("end_run", run)

    def close(self) -> None:
        self._put("close")


def received(path: str | os.PathLike[str]) -> tuple[ListSink, set[int]]:
    """What a FileListSink received, and the pids of the processes it ran in."""
    sink, pids = ListSink(), set()
    if not Path(path).exists():
        return sink, pids
    with open(path, "rb") as f:
        while True:
            try:
                pid, kind, *args = pickle.load(f)
            except EOFError:
                break
            pids.add(pid)
            if kind == "start_run":
                sink.start_run(*args)
            elif kind == "write":
                sink.write(*args)
            elif kind == "end_run":
                sink.end_run(*args)
            elif kind == "close":
                sink.close()
    return sink, pids
