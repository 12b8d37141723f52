"""Issue 15 §1, any sink: a sink that hangs counts as failed — its blocks are spooled, training and
the end of the run go on, and everything is delivered once it answers again."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

import batchtap as bt
from batchtap.records import Event, Record
from batchtap.sinks.resilient import ResilientSink
from tests.conftest import ListSink


class _Hangs(ListSink):
    """Hangs in write() from its 3rd call on, until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.calls = 0

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self.calls += 1
        if self.calls >= 3:
            self.release.wait()
        super().write(records, events)


def test_a_hung_sink_is_spooled_and_delivered_after_it_answers(tmp_path: Path) -> None:
    inner = _Hangs()
    kwargs = {"call_timeout": 0.5} if "call_timeout" in inspect.signature(ResilientSink).parameters else {}
    sink = ResilientSink(inner, spool_path=tmp_path / "s.jsonl", retry_initial=0.05, retry_max=0.2, **kwargs)
    healthy = ListSink()
    done = threading.Event()

    def train() -> None:
        with bt.Tap(sinks=[sink, healthy], flush_every=5, queue_size=2) as tap, tap.run(name="hung"):
            for i in range(200):
                tap.step(loss=torch.tensor(float(i)))
        done.set()

    t = threading.Thread(target=train, daemon=True)
    t.start()
    finished = done.wait(120)  # a hang is what is tested, never a duration
    inner.release.set()
    t.join(60)
    assert finished, "training or leaving run() hung behind the hung sink"
    assert [r.values["loss"] for r in healthy.records] == [float(i) for i in range(200)]
    assert sink.pending  # the hung sink's blocks wait in the spool
    again = ResilientSink(inner, spool_path=tmp_path / "s.jsonl")  # the next start replays them
    again.close()
    assert sorted({r.step for r in inner.records}) == list(range(200))
