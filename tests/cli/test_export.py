"""`batchtap export` (CSV, JSONL round trips) and `batchtap tensorboard` (read back with EventAccumulator)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import batchtap.store
from batchtap.sinks.csv import read_events, read_records
from tests.cli.conftest import Runs, cli


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _stored(db: Path, run_id: str) -> dict[tuple[str, int], tuple[float, float, int, int]]:
    with batchtap.store.open(db) as st:
        return {
            (m, p.step): (p.value, p.wall_time, p.epoch, p.batch)
            for m in st.metric_names(run_id)
            for p in st.series(run_id, m)
        }


def test_csv_export_round_trips_exactly(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "base.csv"
    done = cli("export", "cli-base", "--db", str(runs.db), "--format", "csv", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "base.2.csv").exists()  # one file, every metric in its header
    stored = _stored(runs.db, runs.base)
    got = {}
    for r in read_records(out):
        assert r.run_id == runs.base and r.rank == 0
        for m, v in r.values.items():
            got[(m, r.step)] = (v, r.wall_time, r.epoch, r.batch)
    assert got.keys() == stored.keys()
    for key, (v, w, e, b) in stored.items():
        gv, gw, ge, gb = got[key]
        assert _same(gv, v) and (gw, ge, gb) == (w, e, b), key
    events = read_events(out)
    assert len(events) == 2 and all(e.step == 7 and math.isnan(e.raw_value or 0.0) for e in events)


def test_export_refuses_to_overwrite_without_force(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "x.csv"
    assert cli("export", "cli-clean", "--db", str(runs.db), "-f", "csv", "-o", str(out)).returncode == 0
    again = cli("export", "cli-clean", "--db", str(runs.db), "-f", "csv", "-o", str(out))
    assert again.returncode == 1 and "--force" in again.stderr
    forced = cli("export", "cli-clean", "--db", str(runs.db), "-f", "csv", "-o", str(out), "--force")
    assert forced.returncode == 0
    assert len(read_records(out)) == 36  # replaced, not appended


def test_jsonl_export_to_stdout_round_trips(runs: Runs) -> None:
    done = cli("export", runs.stopped, "--db", str(runs.db), "--format", "jsonl", "-m", "loss", "-m", "accuracy")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[0]["type"] == "run_start" and lines[-1]["type"] == "run_end"
    assert lines[-1]["status"] == "stopped" and lines[0]["config"]["lr"] == 0.1
    records = [x for x in lines if x["type"] == "record"]
    stored = _stored(runs.db, runs.stopped)
    assert len(records) == 21
    for r in records:
        assert set(r) - {"type", "run_id", "step", "epoch", "batch", "rank", "wall_time"} == {"loss", "accuracy"}
        for m in ("loss", "accuracy"):
            v = float(r[m]) if isinstance(r[m], str) else r[m]
            assert _same(v, stored[(m, r["step"])][0])
    kinds = sorted(x["kind"] for x in lines if x["type"] == "event")
    assert kinds == ["action", "action", "anomaly", "anomaly"]


def test_tensorboard_writes_the_stored_run_through_the_sink(runs: Runs, tmp_path: Path) -> None:
    ea_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    logdir = tmp_path / "tb"
    done = cli("tensorboard", "cli-base", "--db", str(runs.db), "--logdir", str(logdir))
    assert done.returncode == 0, done.stderr
    acc = ea_mod.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    stored = _stored(runs.db, runs.base)
    loss = acc.Scalars("train/loss")
    assert [s.step for s in loss] == list(range(36))
    for s in loss:
        v, w, _, _ = stored[("loss", s.step)]
        assert (math.isnan(s.value) and math.isnan(v)) or s.value == pytest.approx(v, rel=1e-6)
        assert s.wall_time == pytest.approx(w)
    assert "train/accuracy" in acc.Tags()["scalars"]
