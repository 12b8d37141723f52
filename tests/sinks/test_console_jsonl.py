"""Console and JSONL sinks, read back."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

import batchtap as bt
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus


def test_console_plain_lines_every_n_batches() -> None:
    stream = io.StringIO()
    sink = bt.sinks.Console(every=10, stream=stream)
    run = RunInfo("abc123", "exp1", {}, 0.0)
    sink.start_run(run)
    sink.write([Record("abc123", b, 0, b, 0, 0.0, {"loss": 0.42131, "accuracy": 0.9125}) for b in range(21)])
    sink.write([], [Event("abc123", 3, EventKind.ANOMALY, "loss=nan at step 3 is not a number", 0.0, "loss", math.nan)])
    run.status = RunStatus.FINISHED
    sink.end_run(run)
    lines = stream.getvalue().splitlines()
    assert lines[1:4] == [
        "epoch 0 batch 0: loss=0.4213 acc=91.25%",
        "epoch 0 batch 10: loss=0.4213 acc=91.25%",
        "epoch 0 batch 20: loss=0.4213 acc=91.25%",
    ]
    assert lines[4] == "batchtap anomaly at step 3: loss=nan is not a number"  # the step named once
    assert lines[5].startswith("batchtap: run 'exp1' finished: 21 steps") and "anomalies: 1" in lines[5]


def test_console_live_bar_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    sink = bt.sinks.Console(stream=stream)
    sink.start_run(RunInfo("r", "live", {}, 0.0))
    sink.write([Record("r", b, 0, b, 0, 0.0, {"loss": 1.0 / (b + 1)}) for b in range(5)])
    sink.end_run(RunInfo("r", "live", {}, 0.0, status=RunStatus.FINISHED))
    out = stream.getvalue()
    assert "epoch 0" in out and "loss=0.2000" in out and "5batch" in out.replace(" ", "")


def test_jsonl_round_trip_through_a_run(tmp_path) -> None:
    path = tmp_path / "deep" / "m.jsonl"
    with bt.Tap([bt.metrics.Loss()], [bt.sinks.JSONL(path)], flush_every=3) as tap:
        with tap.run(name="j", config={"lr": 0.1}):
            for i in range(7):
                tap.step(loss=torch.tensor(math.nan if i == 4 else float(i)))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["type"] == "run_start" and rows[0]["config"] == {"lr": 0.1}
    records = [r for r in rows if r["type"] == "record"]
    assert [r["loss"] for r in records] == [0.0, 1.0, 2.0, 3.0, "nan", 5.0, 6.0]
    events = [r for r in rows if r["type"] == "event"]
    assert {(e["kind"], e["step"], e["raw_value"]) for e in events} >= {("anomaly", 4, "nan")}
    assert rows[-1]["type"] == "run_end" and rows[-1]["status"] == "stopped"
    # append-only: a second run adds lines
    with bt.Tap([bt.metrics.Loss()], [bt.sinks.JSONL(path)]) as tap, tap.run(name="j2"):
        tap.step(loss=torch.tensor(1.0))
    assert len(path.read_text().splitlines()) == len(rows) + 3


def test_jsonl_unwritable_path_is_a_clear_error(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(bt.SinkError, match=r"JSONL sink cannot open .*file/m.jsonl.* choose a writable path"):
        bt.sinks.JSONL(blocker / "m.jsonl")


def _eval(step: int, **values: float) -> Record:
    return Record("abc123", step, 0, -1, 0, 0.0, values, sparse=True)


def test_console_prints_sparse_records_as_their_own_lines_and_skips_summed_up_apart_from_anomalies() -> None:
    stream = io.StringIO()
    sink = bt.sinks.Console(every=5, stream=stream, max_anomaly_lines=2)
    run = RunInfo("abc123", "exp1", {}, 0.0)
    sink.start_run(run)
    steps = [Record("abc123", b, 0, b, 0, 0.0, {"loss": 0.5, "loss_scale": 65536.0}) for b in range(11)]
    skips = [
        Event("abc123", s, EventKind.SKIP, f"step {s}: the AMP GradScaler skipped the optimizer step", 0.0)
        for s in (1, 2, 3)
    ]
    sink.write([*steps[:6], _eval(5, val_loss=0.31, val_acc=0.9), *steps[6:]], skips)
    sink.write([_eval(10, val_loss=math.nan, bleu=27.25)])
    run.status = RunStatus.FINISHED
    sink.end_run(run)
    lines = stream.getvalue().splitlines()
    assert lines[1:] == [
        "epoch 0 batch 0: loss=0.5000 loss_scale=6.554e+04",  # in step order
        # one line for the `every` steps 0..4, at their end: a GradScaler's skips are expected
        "batchtap skip: 3 steps skipped in 0..4 (the AMP GradScaler skipped the optimizer step)",
        "epoch 0 batch 5: loss=0.5000 loss_scale=6.554e+04",
        "eval  step 5  val_loss 0.3100  val_acc 90.00%",
        "epoch 0 batch 10: loss=0.5000 loss_scale=6.554e+04",
        "eval  step 10  val_loss nan  bleu 27.25",
        "batchtap: run 'exp1' finished: 11 steps, last: loss=0.5000 loss_scale=6.554e+04; anomalies: 0; skipped steps: 3",
    ]


def test_console_live_bar_prints_sparse_lines_above_it() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    sink = bt.sinks.Console(stream=stream)
    sink.start_run(RunInfo("abc123", "live", {}, 0.0))
    sink.write([*(Record("abc123", b, 0, b, 0, 0.0, {"loss": 1.0}) for b in range(3)), _eval(2, val_loss=0.25)])
    sink.write([_eval(2, val_acc=0.5)])
    sink.end_run(RunInfo("abc123", "live", {}, 0.0, status=RunStatus.FINISHED))
    out = stream.getvalue()
    assert "eval  step 2  val_loss 0.2500" in out and "eval  step 2  val_acc 50.00%" in out
    assert "3batch" in out.replace(" ", "") and "finished: 3 steps, last: loss=1.0000" in out


def test_jsonl_sparse_records_are_record_lines_marked_sparse(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    sink = bt.sinks.JSONL(path)
    sink.write(
        [Record("abc123", 4, 0, 4, 0, 1.0, {"loss": 0.5}), _eval(4, val_loss=0.25, val_acc=math.nan)],
        [Event("abc123", 4, EventKind.SKIP, "skipped", 1.0)],
    )
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {
        "type": "record",
        "run_id": "abc123",
        "step": 4,
        "epoch": 0,
        "batch": 4,
        "rank": 0,
        "wall_time": 1.0,
        "loss": 0.5,
    }
    assert rows[1] == {
        "type": "record", "run_id": "abc123", "step": 4, "epoch": 0, "batch": -1, "rank": 0, "wall_time": 0.0,
        "sparse": True, "val_loss": 0.25, "val_acc": "nan",
    }  # fmt: skip
    assert rows[2]["type"] == "event" and rows[2]["kind"] == "skip"


def test_values_logged_at_every_step_print_once_per_every_steps_and_evaluation_always() -> None:
    # Lightning's self.log(..., on_step=True) logs at every training step: one eval line per step
    # would drown the step lines (issue 29 item 5); evaluation values, logged far apart, all print.
    stream = io.StringIO()
    console = bt.sinks.Console(every=10, stream=stream, live=False)
    run = RunInfo(id="r", name="r", config={}, started_at=0.0)
    console.start_run(run)
    for step in range(30):
        console.write([Record("r", step, 0, step, 0, float(step), {"train_loss": 1.0}, sparse=True)])
    for step in (100, 105):
        console.write([Record("r", step, 1, 0, 0, float(step), {"val_loss": 0.5}, sparse=True)])
    console.end_run(RunInfo(id="r", name="r", config={}, started_at=0.0, status=RunStatus.FINISHED))
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("eval")]
    assert [line.split()[2] for line in lines] == ["0", "10", "20", "100"]
