"""A JSONL file is the record codec's lines: it reads back (``read_jsonl``) and replays into any
sink (``replay``) as if that sink had watched the run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import batchtap as bt
import batchtap.store
from batchtap.records import Event, EventKind, Record, RunEnd, RunInfo, RunStart, RunStatus, Write, format_float
from batchtap.sinks.jsonl import JSONL, read_jsonl, replay
from batchtap.sinks.sqlite import SQLite
from batchtap.store import Store
from tests.conftest import ListSink

NAN_AT = (1, 3)  # (epoch, batch) whose loss diverges


def _train(jsonl: Path, db: Path) -> None:
    """A small classifier trained on the CPU the usual way: a watched loader, an optimizer step, an
    evaluation logged with ``tap.log()`` after each epoch; its loss turns NaN at ``NAN_AT``."""
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(), bt.metrics.StepTime()]
    with bt.Tap(metrics, [JSONL(jsonl), SQLite(db)], flush_every=4) as tap:
        with tap.run(name="replayed", config={"lr": 0.1, "note": "nan", "layers": [8, 16, 3]}):
            for epoch in range(3):
                for batch, (xb, yb) in enumerate(tap.watch(loader, epoch=epoch)):
                    out = model(xb)
                    loss = F.cross_entropy(out, yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if (epoch, batch) == NAN_AT:
                        loss = loss * math.nan
                    tap.step(loss=loss, outputs=out, targets=yb)
                    if tap.should_stop:
                        break
                with torch.no_grad():
                    val = F.cross_entropy(model(x), y)
                tap.log({"val_loss": val, "val_acc": 0.5, "val_ppl": math.inf if epoch else 3.25})
                if tap.should_stop:
                    break


def _floats(x: object) -> object:
    """Floats as the codec's text (so NaN compares equal to NaN); tuples and lists element-wise."""
    if isinstance(x, float):
        return format_float(x)
    if isinstance(x, (tuple, list)):
        return tuple(_floats(v) for v in x)
    return x


def _contents(store: Store) -> list[object]:
    """Everything a store holds about its runs, as the reader gives it."""
    out: list[object] = []
    for run in store.runs():
        out.append(run)
        names = store.metric_names(run.id)
        out.append(names)
        out.append(store.sparse_names(run.id))
        for name in names:
            out.append((name, [_floats(tuple(p)) for p in store.series(run.id, name)]))
        out.append([_floats(m) for m in store.iter_metrics(run.id)])
        out.append([(r.run_id, r.step, r.epoch, r.batch, r.rank, _floats(r.wall_time), r.sparse,
                     {k: _floats(v) for k, v in r.values.items()}) for r in store.sparse_records(run.id)])  # fmt: skip
        out.append([(e.run_id, e.step, e.kind, e.message, _floats(e.wall_time), e.metric, _floats(e.raw_value), e.rank)
                    for e in store.events(run.id)])  # fmt: skip
    return out


def test_a_jsonl_file_replayed_into_a_fresh_store_gives_the_same_store(tmp_path: Path) -> None:
    jsonl, live, replayed = tmp_path / "m.jsonl", tmp_path / "live.db", tmp_path / "replayed.db"
    _train(jsonl, live)
    target = SQLite(replayed)
    fed = replay(jsonl, target)
    target.close()
    assert fed == len(jsonl.read_text().splitlines())
    with batchtap.store.open(live) as a, batchtap.store.open(replayed) as b:
        (run,) = a.runs()
        # the run has what makes a replay hard: a NaN step, logged values (one inf), an anomaly
        assert run.status is RunStatus.STOPPED and run.config["note"] == "nan"
        loss = {p.step: p.value for p in a.series(run.id, "loss")}
        assert sum(math.isnan(v) for v in loss.values()) == 1
        logged = a.sparse_records(run.id)
        assert len(logged) == 2 and logged[-1].values["val_ppl"] == math.inf
        assert any(e.kind is EventKind.ANOMALY and e.raw_value is not None and math.isnan(e.raw_value)
                   for e in a.events(run.id))  # fmt: skip
        assert _contents(b) == _contents(a)
    again = SQLite(replayed)
    replay(jsonl, again)  # a second replay stores nothing twice
    again.close()
    with batchtap.store.open(live) as a, batchtap.store.open(replayed) as b:
        assert _contents(b) == _contents(a)


def test_read_jsonl_gives_back_what_the_sink_was_given(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    run = RunInfo("r1", "odd names", {"lr": 0.1}, 10.0, metrics=("step", "metric:x", "loss"))
    records = [
        Record("r1", 0, 0, 0, 0, 10.5, {"step": 0.25, "metric:x": -0.0, "loss": math.nan}),
        Record("r1", 0, 0, -1, 0, 10.75, {"val": 5e-324}, sparse=True),
    ]
    events = [Event("r1", 0, EventKind.ANOMALY, "loss is nan", 10.5, metric="loss", raw_value=math.nan)]
    sink = JSONL(path)
    sink.start_run(run)
    sink.write(records, events)
    ended = RunInfo("r1", "odd names", {"lr": 0.1}, 10.0, RunStatus.FAILED, 11.0, "boom", metrics=run.metrics)
    sink.end_run(ended)
    sink.close()
    got = list(read_jsonl(path))
    assert [type(m) for m in got] == [RunStart, Record, Record, Event, RunEnd]
    assert got[0] == RunStart(run) and got[-1] == RunEnd(ended)
    a, b = got[1], got[2]
    assert isinstance(a, Record) and isinstance(b, Record)
    assert list(a.values) == ["step", "metric:x", "loss"] and math.isnan(a.values["loss"])
    assert math.copysign(1.0, a.values["metric:x"]) == -1.0 and a.values["step"] == 0.25
    assert b == records[1]
    ev = got[3]
    assert isinstance(ev, Event) and ev.metric == "loss" and ev.raw_value is not None and math.isnan(ev.raw_value)


def test_a_torn_last_line_is_skipped_with_a_warning_and_a_damaged_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JSONL(path)
    sink.write([Record("r", s, 0, s, 0, 0.0, {"loss": 1.0}) for s in range(3)])
    sink.close()
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[0][:30])  # a writer killed mid-line
    with pytest.warns(RuntimeWarning, match=r"line 4 is incomplete"):
        assert [m.step for m in read_jsonl(path)] == [0, 1, 2]  # type: ignore[union-attr]
    lines = whole.splitlines()
    path.write_text("\n".join([lines[0], '{"type":"record","step":1}', lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl line 2 is not a batchtap JSONL line: a 'record' object lacks"):
        list(read_jsonl(path))


def test_replay_keeps_the_order_of_runs_and_blocks(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    sink = JSONL(path)
    for run_id in ("a", "b"):
        sink.start_run(RunInfo(run_id, run_id, {}, 0.0))
        sink.write([Record(run_id, s, 0, s, 0, 0.0, {"loss": 1.0}) for s in range(5)],
                   [Event(run_id, 4, EventKind.WARNING, "slow", 0.0)])  # fmt: skip
        sink.end_run(RunInfo(run_id, run_id, {}, 0.0, RunStatus.FINISHED, 1.0))
    sink.close()
    into = ListSink()
    assert replay(path, into, block_size=4) == 2 * (1 + 5 + 1 + 1)
    assert [r.id for r in into.started] == ["a", "b"] and [r.status for r in into.ended] == [RunStatus.FINISHED] * 2
    assert [(r.run_id, r.step) for r in into.records] == [(i, s) for i in "ab" for s in range(5)]
    assert into.writes == 4  # per run: 4 records, then the 5th with its event; a new run starts a new block
    assert [e.run_id for e in into.events] == ["a", "b"]


def test_a_spool_file_replays_by_hand(tmp_path: Path) -> None:
    """A ResilientSink spool (or quarantine file) is codec lines too: ``write`` lines, one per block."""
    from batchtap.sinks.resilient import encode_entry

    run = RunInfo("r", "spooled", {}, 0.0)
    block = [Record("r", s, 0, s, 0, 0.0, {"loss": 0.5}) for s in range(3)]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(encode_entry(entry) + "\n" for entry in [RunStart(run), Write(block)]))
    assert [type(m) for m in read_jsonl(path)] == [RunStart, Write]
    into = ListSink()
    replay(path, into)
    assert into.started == [run] and into.records == block
