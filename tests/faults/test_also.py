"""Issue 15, "Also": hostile numbers and meta tensors, a locked store, a full disk under the JSONL
sink, and drops under ``drop_oldest`` counted where they are seen."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import batchtap as bt
from batchtap.errors import InputError, SinkError
from batchtap.records import Event, Record
from tests.conftest import ListSink
from tests.faults._procs import env


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"loss": torch.tensor(1.0), "extra": {"x": 10**400}}, id="huge-int-extra"),
        pytest.param({"loss": torch.tensor(1.0), "tokens": 10**400}, id="huge-int-tokens"),
        pytest.param({"loss": torch.empty((), device="meta")}, id="meta-loss"),
    ],
)
def test_hostile_numbers_and_meta_tensors_are_input_errors_and_lose_nothing(kwargs: dict) -> None:
    """(At the first step a meta loss is refused as a meta tensor; later, as one on the wrong device.)"""
    sink = ListSink()
    with bt.Tap(sinks=[sink], flush_every=2) as tap, tap.run():
        tap.step(loss=torch.tensor(0.5), **({"extra": {"x": 1}} if "extra" in kwargs else {}))
        with pytest.raises(InputError, match="meta" if "loss" in kwargs and kwargs["loss"].is_meta else "fix:"):
            tap.step(**kwargs)
        tap.step(loss=torch.tensor(0.25), **({"extra": {"x": 2}} if "extra" in kwargs else {}))
    assert [r.values["loss"] for r in sink.records] == [0.5, 0.25]


HOLDER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()  # hold the write lock until told
conn.execute("ROLLBACK")
"""


def test_a_locked_store_names_the_holder_and_what_helps(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    sink = bt.sinks.SQLite(db, busy_timeout_s=0.2)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env()
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(SinkError) as err:
            sink.write([Record("r", 0, 0, 0, 0, 0.0, {"loss": 1.0})])
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=60)
    message = str(err.value)
    assert f"process {holder.pid}" in message, message
    assert "spool_dir" in message and "busy_timeout_s" in message
    assert "disk space" not in message
    sink.write([Record("r", 0, 0, 0, 0, 0.0, {"loss": 1.0})])  # the lock is gone: it works again
    sink.close()


FILL = """
import resource, signal, sys
from batchtap.records import Record
from batchtap.sinks.jsonl import JSONL
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, like ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))
sink = JSONL(sys.argv[1])
failures = 0
for block in range(200):
    records = [Record("r", block * 7 + i, 0, i, 0, 0.5, {"loss": 0.1 * i, "accuracy": 0.9}) for i in range(7)]
    try:
        sink.write(records)
    except Exception as exc:
        failures += 1
print(failures)
sink.close()
"""


def test_a_full_disk_never_leaves_half_a_jsonl_record(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", FILL, str(path)], capture_output=True, text=True, env=env(), timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 0  # the limit was hit
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    lines = text.splitlines()
    assert all(json.loads(line)["type"] == "record" for line in lines)
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == list(range(len(steps))) and len(steps) % 7 == 0  # whole blocks, in order


class _Gated(ListSink):
    """Holds its first write until released: the queue behind it fills and drops."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self.entered.set()
        self.gate.wait()
        super().write(records, events)


def test_drops_under_drop_oldest_are_counted_exactly_in_the_dropping_sink_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    slow = _Gated()
    steps = 200
    with caplog.at_level(logging.WARNING, logger="batchtap"):
        with (
            bt.Tap(sinks=[slow], flush_every=1, queue_size=1, backpressure="drop_oldest") as tap,
            tap.run(name="drops"),
        ):
            for i in range(steps):
                tap.step(loss=torch.tensor(float(i)))
            assert slow.entered.wait(60)
            slow.gate.set()
    got = len([r for r in slow.records if not r.sparse])
    summary = [e.message for e in slow.events if "under backpressure='drop_oldest'" in e.message]
    assert len(summary) == 1, [e.message for e in slow.events][-5:]
    dropped = int(summary[0].split("blocks (")[1].split()[0])
    assert dropped > 0 and got + dropped == steps
    assert any(f"({dropped} records)" in r.getMessage() for r in caplog.records)


def test_a_meta_loss_at_the_first_step_is_an_input_error() -> None:
    with bt.Tap(sinks=[]) as tap, tap.run():
        with pytest.raises(InputError, match="meta tensor .*fix:"):
            tap.step(loss=torch.empty((), device="meta"))
        tap.step(loss=torch.tensor(1.0))
        assert tap.steps_recorded == 1
