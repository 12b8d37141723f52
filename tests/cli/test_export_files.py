"""Issue 29 item 5: ``export -o`` writes the events file the docs promise even for a run without
events (CSV and Parquet), and the Parquet column of ``tap.log()`` rows is ``logged``, not
``sparse`` (which would hide pandas' ``DataFrame.sparse`` accessor); old files still read back."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from batchtap.records import Record, RunInfo
from batchtap.sinks.csv import EVENT_FIELDS
from batchtap.sinks.csv import events_path as csv_events
from batchtap.sinks.sqlite import SQLite
from batchtap.store.parquet import events_path, read_events, read_records, write_run
from tests.cli.conftest import cli


def _quiet_run(db: Path) -> None:
    sink = SQLite(db)
    sink.start_run(RunInfo("q" * 32, "quiet", {}, started_at=0.0))
    sink.write(
        [Record("q" * 32, step=s, epoch=0, batch=s, rank=0, wall_time=1.0 + s, values={"loss": 1.0}) for s in range(3)]
    )
    sink.write([Record("q" * 32, step=2, epoch=0, batch=-1, rank=0, wall_time=3.5, values={"val": 0.5}, sparse=True)])
    sink.close()


def test_csv_export_of_a_run_without_events_writes_the_events_file_with_its_header(tmp_path: Path) -> None:
    db, out = tmp_path / "bt.db", tmp_path / "quiet.csv"
    _quiet_run(db)
    done = cli("export", "quiet", "--db", str(db), "-f", "csv", "-o", str(out))
    assert done.returncode == 0, done.stderr
    with csv_events(out).open(newline="") as f:
        assert list(csv.reader(f)) == [list(EVENT_FIELDS)]


def test_parquet_export_of_a_run_without_events_writes_an_empty_events_table(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    db, out = tmp_path / "bt.db", tmp_path / "quiet.parquet"
    _quiet_run(db)
    done = cli("export", "quiet", "--db", str(db), "-f", "parquet", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "as rows with logged=true" in done.stderr
    table = pq.read_table(events_path(out))
    assert table.num_rows == 0 and "message" in table.column_names
    assert read_events(out) == []


def test_the_logged_column_leaves_pandas_sparse_accessor_alone(tmp_path: Path) -> None:
    pd = pytest.importorskip("pandas")
    out = tmp_path / "run.parquet"
    records = [
        Record("r", step=0, epoch=0, batch=0, rank=0, wall_time=1.0, values={"loss": 0.5}),
        Record("r", step=0, epoch=0, batch=-1, rank=0, wall_time=1.5, values={"val": 0.9}, sparse=True),
    ]
    write_run(out, RunInfo("r", "r", {}, started_at=0.0), records)
    frame = pd.read_parquet(out)
    assert list(frame["logged"]) == [False, True]
    assert "sparse" not in frame.columns
    with pytest.raises(AttributeError, match="Sparse"):  # pandas' accessor, not a column of ours
        frame.sparse  # noqa: B018
    assert [(r.sparse, dict(r.values)) for r in read_records(out)] == [(False, {"loss": 0.5}), (True, {"val": 0.9})]


def test_a_file_written_with_the_old_sparse_column_still_reads_back(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "old.parquet"
    write_run(
        out,
        RunInfo("r", "r", {}, started_at=0.0),
        [Record("r", step=0, epoch=0, batch=-1, rank=0, wall_time=1.5, values={"val": 0.9}, sparse=True)],
    )
    table = pq.read_table(out)
    old = table.rename_columns(["sparse" if c == "logged" else c for c in table.column_names])
    pq.write_table(old.replace_schema_metadata(table.schema.metadata), out)
    assert "sparse" in pq.read_schema(out).names and pa is not None
    assert [(r.sparse, dict(r.values)) for r in read_records(out)] == [(True, {"val": 0.9})]
