"""``bt.ui.start()`` runs inside the user's process: it must leave the process's logging as it
found it. uvicorn's own log configuration (``logging.config.dictConfig``) shuts down every handler
the process ever made; absl's handler (made when TensorFlow is imported) then closes the stream it
was made with, which under a notebook or a test runner is a stream somebody else owns."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

import batchtap as bt  # noqa: E402
from batchtap.records import Record, RunInfo, RunStatus  # noqa: E402
from batchtap.sinks.sqlite import SQLite  # noqa: E402


class _ClosesItsStream(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler that closes its stream when it is closed (as absl's does)."""

    def close(self) -> None:
        self.stream.close()
        super().close()


def test_start_leaves_the_processs_handlers_and_their_streams_alone(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    sink = SQLite(db)
    sink.start_run(RunInfo("r0000001", "r", {}, started_at=1.0))
    sink.write([Record("r0000001", step=0, epoch=0, batch=0, rank=0, wall_time=1.0, values={"loss": 1.0})])
    sink.end_run(RunInfo("r0000001", "r", {}, started_at=1.0, status=RunStatus.FINISHED, ended_at=2.0))
    sink.close()

    owned = io.StringIO()
    handler = _ClosesItsStream(owned)  # made, as absl's is, without being attached anywhere
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        with bt.ui.start(db) as server:
            assert server.url.startswith("http://127.0.0.1:")
        assert not owned.closed, "starting the UI closed a stream another library's log handler owns"
        assert root.handlers == before
    finally:
        handler.close()
