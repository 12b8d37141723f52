"""The pipeline thread reads a block before it frees the block's ring slots, every time.

Freeing first would let the training thread overwrite rows that were never read: wrong values that
look plausible. A race test can only catch that by luck; here a flusher that logs what the pipeline
thread does (read start, read end, release, and how many rows were released at each point) shows
the order itself, for every block, whatever the scheduling.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from batchtap.capture import flush
from batchtap.capture.clock import HostClock
from batchtap.capture.flush import Block, BlockData, Flusher
from batchtap.capture.ring import MetricRing
from batchtap.metrics import Loss
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain.control import Control
from batchtap.pipeline.transport.thread import ThreadPipeline
from tests.conftest import ListSink


class LoggingFlusher(Flusher):
    """Logs the pipeline's read of each block (its marker polled first, its rows copied into a
    BlockData last) and the release of its slots."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.log: list[tuple[str, int, int]] = []  # (what, block's first row, rows released then)
        self._lock = threading.Lock()
        self.reading: int | None = None

    def note(self, what: str) -> None:
        with self._lock:
            assert self.reading is not None
            self.log.append((what, self.reading, self.released))

    def release(self, block: Block) -> None:
        with self._lock:
            self.log.append(("release", block.first_row, self.released))
        super().release(block)


class LoggingClock(HostClock):
    flusher: LoggingFlusher
    blocks: dict[object, int]

    def block_marker(self) -> object:
        return object()  # one marker per block, so the log can name the block being read

    def marker_done(self, marker: object) -> bool:
        if self.flusher.reading != self.blocks[marker]:
            self.flusher.reading = self.blocks[marker]
            self.flusher.note("read")
        return super().marker_done(marker)


def test_every_block_is_read_before_its_slots_are_released(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Layout([Loss()])
    ring = MetricRing(
        capacity=4,
        device_width=layout.device_width,
        host_width=layout.host_width,
        device=torch.device("cpu"),
        guard_column=layout.guard_column,
    )
    clock = LoggingClock(4)
    flusher = LoggingFlusher(ring, clock, flush_every=2, flush_seconds=None)
    clock.flusher, clock.blocks = flusher, {}

    def logged_block_data(**columns: object) -> BlockData:
        data = BlockData(**columns)  # type: ignore[arg-type]
        flusher.note("read done")  # every row copied
        return data

    monkeypatch.setattr(flush, "BlockData", logged_block_data)
    sink = ListSink()
    pipeline = ThreadPipeline([sink], Control())
    run = pipeline.open_chain(layout, run_id="r", rank=0, writes=True, reduce=None)
    try:
        for step in range(12):
            slot = flusher.claim(step)  # waits for a release when the pipeline is a ring behind
            ring.write(
                slot,
                [torch.tensor(step / 4)],
                [],
                step=step,
                epoch=0,
                batch=step,
                wall_time=0.0,
                samples=1.0,
                data_time=math.nan,
            )
            flusher.commit_row()
            if flusher.due():
                block = flusher.flush()
                assert block is not None
                clock.blocks[block.marker] = block.first_row
                pipeline.submit(block, run)
        assert pipeline.drain(30)
        assert pipeline.flush_sinks(30)
    finally:
        pipeline.close()
    assert [r.values["loss"] for r in sink.records] == [s / 4 for s in range(12)]
    firsts = list(range(0, 12, 2))
    expected = [
        entry
        for first in firsts
        for entry in (("read", first, first), ("read done", first, first), ("release", first, first))
    ]
    assert flusher.log == expected  # read, then release; nothing released before its read ended
