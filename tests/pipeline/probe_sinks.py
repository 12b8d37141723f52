"""A sink that reports which modules its process had loaded at each call (kept free of torch,
TensorFlow and tests.conftest, so that importing it in a pipeline process loads none of them).
Shared by the pipeline tests (torch) and the Keras tests (torch and tensorflow)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.base import Sink


class ModulesSink(Sink):
    """Appends one JSON line per call to ``path``: the call, the pid, and for each of ``modules``
    whether it was in ``sys.modules`` (default: torch only)."""

    def __init__(self, path: str | os.PathLike[str], modules: Sequence[str] = ("torch",)) -> None:
        self.path = str(path)
        self.modules = tuple(modules)

    def _note(self, call: str) -> None:
        loaded = {name: name in sys.modules for name in self.modules}
        with open(self.path, "a") as f:
            f.write(json.dumps({"call": call, "pid": os.getpid(), **loaded}) + "\n")

    def start_run(self, run: RunInfo) -> None:
        self._note("start_run")

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self._note("write")

    def end_run(self, run: RunInfo) -> None:
        self._note("end_run")


def notes(path: str | os.PathLike[str]) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]
