"""The pipeline thread reads a block before it frees the block's ring slots, every time.

Freeing first would let the training thread overwrite rows that were never read: wrong values that
look plausible. A race test can only catch that by luck; here a flusher that logs what the pipeline
thread does (read start, read end, release, and how many rows were released at each point) shows
the order itself, for every block, whatever the scheduling.
"""

from __future__ import annotations

import math
import threading

import torch

from batchtap.capture.clock import HostClock
from batchtap.capture.flush import Block, BlockData, Flusher
from batchtap.capture.ring import MetricRing
from batchtap.metrics import Loss
from batchtap.metrics.layout import Layout
from batchtap.pipeline.decode import Decoder
from batchtap.pipeline.dispatch import Dispatcher
from batchtap.pipeline.harvest import Harvester, RunPipeline
from tests.conftest import ListSink


class LoggingFlusher(Flusher):
    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.log: list[tuple[str, int, int]] = []  # (what, block's first row, rows released then)
        self._lock = threading.Lock()

    def read(self, block: Block, gate=None) -> BlockData:  # type: ignore[no-untyped-def]
        with self._lock:
            self.log.append(("read", block.first_row, self.released))
        data = super().read(block, gate)
        with self._lock:
            self.log.append(("read done", block.first_row, self.released))
        return data

    def release(self, block: Block) -> None:
        with self._lock:
            self.log.append(("release", block.first_row, self.released))
        super().release(block)


def test_every_block_is_read_before_its_slots_are_released() -> None:
    layout = Layout([Loss()])
    ring = MetricRing(capacity=4, device_width=layout.device_width, host_width=layout.host_width,
                      device=torch.device("cpu"), guard_column=layout.guard_column)
    flusher = LoggingFlusher(ring, HostClock(4), flush_every=2, flush_seconds=None)
    sink = ListSink()
    dispatcher = Dispatcher([sink])
    harvester = Harvester(dispatcher, on_block=[], on_error=lambda exc: None)
    run = RunPipeline(Decoder(layout, run_id="r", rank=0))
    try:
        for step in range(12):
            slot = flusher.claim(step)  # waits for a release when the pipeline is a ring behind
            ring.write(slot, [torch.tensor(step / 4)], [], step=step, epoch=0, batch=step, wall_time=0.0,
                       samples=1.0, data_time=math.nan)
            flusher.rows += 1
            if flusher.due():
                block = flusher.flush()
                assert block is not None
                harvester.submit(flusher, block, run)
        assert harvester.drain(30)
        assert dispatcher.flush(30)
    finally:
        harvester.close()
        dispatcher.close()
    assert [r.values["loss"] for r in sink.records] == [s / 4 for s in range(12)]
    firsts = list(range(0, 12, 2))
    expected = [entry for first in firsts for entry in
                (("read", first, first), ("read done", first, first), ("release", first, first))]
    assert flusher.log == expected  # read, then release; nothing released before its read ended
