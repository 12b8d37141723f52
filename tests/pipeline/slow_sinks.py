"""A sink slow to store, for tests that need a pipeline running behind training. It lives at module
level so a pipeline process can unpickle it, and it leaves what it receives in a file (see
:class:`~tests.pipeline.process_sinks.FileListSink`)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from batchtap.records import Event, Record
from tests.pipeline.process_sinks import FileListSink


class SlowFileSink(FileListSink):
    """Takes ``delay`` seconds over each write (a remote store far away), then keeps the call."""

    def __init__(self, path: str | os.PathLike[str], delay: float) -> None:
        super().__init__(path)
        self.delay = delay

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        time.sleep(self.delay)
        super().write(records, events)
