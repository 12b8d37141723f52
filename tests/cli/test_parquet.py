"""`batchtap export --format parquet`: read back with pyarrow (nulls apart from NaN), with pandas,
and with batchtap's own reader; logged values as rows of their own; events beside the file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import batchtap.store
from batchtap.records import EventKind, RunStatus
from batchtap.store.parquet import events_path, read_events, read_records, read_run
from tests.cli.conftest import Runs, cli
from tests.cli.test_logged import _run

pq = pytest.importorskip("pyarrow.parquet")
pd = pytest.importorskip("pandas")


def test_parquet_export_of_a_run_with_logged_values_round_trips(tmp_path: Path) -> None:
    db = tmp_path / "bt.db"
    steps, sparse = _run(db, "evals", "e" * 32, 0)
    out = tmp_path / "evals.parquet"
    done = cli("export", "evals", "--db", str(db), "-f", "parquet", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert (
        f"wrote 30 records and 2 events to {out} (4 records of tap.log() values as rows with logged=true)"
        in done.stderr
    )
    # batchtap's reader: exactly the records the sink was given, each logged record after its step
    got = read_records(out)
    assert [r for r in got if not r.sparse] == steps
    assert [r for r in got if r.sparse] == sparse
    assert [(r.step, r.sparse) for r in got] == sorted((r.step, r.sparse) for r in got)
    run = read_run(out)
    assert run.id == "e" * 32 and run.status is RunStatus.FINISHED and run.config == {"lr": 0.1}
    assert [(e.step, e.kind) for e in read_events(out)] == [(1, EventKind.SKIP), (2, EventKind.SKIP)]
    assert events_path(out).name == "evals.events.parquet"
    # pyarrow: typed columns; a logged row has nulls in the step metrics and vice versa
    table = pq.read_table(out)
    assert table.column_names == [
        "run_id", "step", "epoch", "batch", "rank", "wall_time", "logged",
        "loss", "accuracy", "loss_scale", "amp_skipped", "val_acc", "val_loss", "test_acc",
    ]  # fmt: skip
    assert str(table.schema.field("step").type) == "int64" and str(table.schema.field("loss").type) == "double"
    assert table.column("loss").null_count == 4 and table.column("val_loss").null_count == 31
    # pandas: the user's one-liner to get the evaluation curve
    frame = pd.read_parquet(out)
    evals = frame[frame["logged"]].set_index("step")["val_acc"].dropna()
    assert evals.to_dict() == {r.step: r.values["val_acc"] for r in sparse if "val_acc" in r.values}


def test_parquet_keeps_nan_apart_from_no_value(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "base.parquet"
    done = cli("export", "cli-base", "--db", str(runs.db), "-f", "parquet", "-o", str(out))
    assert done.returncode == 0, done.stderr
    loss = pq.read_table(out).column("loss").to_pylist()
    with batchtap.store.open(runs.db) as st:
        stored = [p.value for p in st.series(runs.base, "loss")]
    assert len(loss) == len(stored) and None not in loss  # every step has a loss: no nulls
    assert [math.isnan(v) for v in loss] == [math.isnan(v) for v in stored]  # the failed one is NaN
    assert sum(math.isnan(v) for v in loss) == 1
    assert all(a == b for a, b in zip(loss, stored, strict=True) if not math.isnan(a))
    events = read_events(out)
    assert len(events) == 2 and all(e.step == 7 and math.isnan(e.raw_value or 0.0) for e in events)


def test_parquet_needs_a_file_and_refuses_to_overwrite(runs: Runs, tmp_path: Path) -> None:
    to_stdout = cli("export", "cli-clean", "--db", str(runs.db), "-f", "parquet")
    assert to_stdout.returncode == 2 and "fix: pass -o FILE.parquet" in to_stdout.stderr and not to_stdout.stdout
    out = tmp_path / "clean.parquet"
    assert cli("export", "cli-clean", "--db", str(runs.db), "-f", "parquet", "-o", str(out)).returncode == 0
    again = cli("export", "cli-clean", "--db", str(runs.db), "-f", "parquet", "-o", str(out))
    assert again.returncode == 1 and "--force" in again.stderr
    picked = cli("export", "cli-clean", "--db", str(runs.db), "-f", "parquet", "-o", str(out), "--force", "-m", "loss")
    assert picked.returncode == 0, picked.stderr
    assert pq.read_table(out).column_names[7:] == ["loss"]  # replaced, with only the metric asked for
