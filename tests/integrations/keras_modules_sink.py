"""A sink noting, at each call, whether its process had loaded torch or TensorFlow (kept free of
both, and of tests.conftest, so that a pipeline process importing it loads neither)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from batchtap.records import Event, Record, RunInfo
from batchtap.sinks.base import Sink


class FrameworksSink(Sink):
    """Appends one JSON line per call to ``path``: the call, the pid, and which of torch and
    tensorflow were in ``sys.modules``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)

    def _note(self, call: str) -> None:
        loaded = {name: name in sys.modules for name in ("torch", "tensorflow")}
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
