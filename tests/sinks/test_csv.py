"""``bt.sinks.CSV``: read back with the csv module."""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

import pytest

from batchtap.errors import SinkError
from batchtap.records import Record
from batchtap.sinks.csv import (
    CSV,
    POSITION_FIELDS,
    SPARSE_FIELDS,
    part_paths,
    read_events,
    read_records,
    read_sparse_records,
    sparse_path,
)
from tests.store._helpers import ODD_NAMES, make_events, make_records, make_skips, make_sparse, same_float


def _read(path: Path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_header_comes_from_the_first_record_and_floats_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    records = make_records("r", range(30), ["loss", "acc"], random.Random(40), nan_every=4)
    sink = CSV(path)
    sink.write(records[:15])
    sink.write(records[15:])
    sink.close()
    rows = _read(path)
    assert rows[0] == [*POSITION_FIELDS, "loss", "acc"]
    assert len(rows) == 31
    for row, r in zip(rows[1:], records):
        assert row[0] == r.run_id and int(row[1]) == r.step and float(row[5]) == r.wall_time
        assert same_float(float(row[6]), r.values["loss"]) and same_float(float(row[7]), r.values["acc"])
    assert sum(row[6] == "nan" for row in rows[1:]) == len(range(0, 30, 4))


def test_a_column_that_appears_later_goes_to_a_new_part_and_nothing_is_lost(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    rng = random.Random(41)
    first = make_records("r", range(5), ["loss"], rng)
    later = make_records("r", range(5, 10), ["loss", "grad_norm"], rng)
    partial = make_records("r", range(10, 12), ["grad_norm"], rng)  # loss missing here
    sink = CSV(path)
    sink.write(first)
    sink.write(later)
    sink.write(partial)
    sink.close()
    assert [p.name for p in part_paths(path)] == ["m.csv", "m.2.csv"]
    assert _read(path)[0] == [*POSITION_FIELDS, "loss"]
    part2 = _read(tmp_path / "m.2.csv")
    assert part2[0] == [*POSITION_FIELDS, "loss", "grad_norm"]
    assert part2[-1][6] == ""  # missing, not NaN
    back = read_records(path)
    assert [r.step for r in back] == list(range(12))
    for got, want in zip(back, first + later + partial):
        assert dict(got.values) == dict(want.values)


def test_appending_to_an_existing_file_continues_its_last_part(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    rng = random.Random(42)
    sink = CSV(path)
    sink.write(make_records("a", range(3), ["loss"], rng))
    sink.write(make_records("a", range(3, 5), ["loss", "lr"], rng))
    sink.close()
    sink = CSV(path)  # a second run, same file
    sink.write(make_records("b", range(2), ["loss", "lr"], rng))
    sink.close()
    assert len(part_paths(path)) == 2
    assert [r.run_id for r in read_records(path)] == ["a"] * 5 + ["b"] * 2


def test_odd_metric_names_and_clashing_names(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    names = [*ODD_NAMES, "step"]
    records = make_records("r", range(3), names, random.Random(43))
    sink = CSV(path)
    sink.write(records)
    sink.close()
    assert "metric:step" in _read(path)[0]
    back = read_records(path)
    assert [dict(r.values) for r in back] == [dict(r.values) for r in records]
    assert [r.step for r in back] == [0, 1, 2]


def test_events_go_to_their_own_file(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    events = make_events("r")
    sink = CSV(path)
    sink.write(make_records("r", range(8), ["loss"], random.Random(44)), events)
    sink.close()
    back = read_events(path)
    assert [(e.step, e.kind, e.metric, e.message) for e in back] == [
        (e.step, e.kind, e.metric, e.message) for e in events
    ]
    assert back[0].raw_value == 1.5 and math.isnan(back[1].raw_value) and back[2].raw_value == -math.inf  # type: ignore[arg-type]
    assert back[3].raw_value is None


def test_unwritable_path_fails_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(SinkError, match=r"a-file.*fix"):
        CSV(blocker / "m.csv")


def test_a_foreign_csv_is_not_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "people.csv"
    path.write_text("name,age\nada,36\n")
    with pytest.raises(SinkError, match=r"not a batchtap CSV"):
        CSV(path)
    assert path.read_text() == "name,age\nada,36\n"


def test_an_empty_block_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    sink = CSV(path)
    sink.write([])
    sink.write([Record("r", step=0, epoch=0, batch=0, rank=0, wall_time=0.5, values={"x": 1.0})])
    sink.close()
    assert _read(path) == [[*POSITION_FIELDS, "x"], ["r", "0", "0", "0", "0", "0.5", "1.0"]]


def test_sparse_records_go_to_a_long_form_sidecar_and_leave_the_header_alone(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    rng = random.Random(45)
    steps = make_records("r", range(20), ["loss", "acc"], rng)
    evals = make_sparse("r", [9, 19], rng)
    late = make_sparse("r", [19], rng, names=("bleu", "step"))  # new names, one like a position column
    sink = CSV(path)
    sink.write([*steps[:10], evals[0], *steps[10:]])  # mixed in one block
    sink.write([evals[1], late[0]])  # sparse only
    sink.close()
    assert [p.name for p in part_paths(path)] == ["m.csv"]  # no new part for names never declared
    assert _read(path)[0] == [*POSITION_FIELDS, "loss", "acc"]
    assert [(r.step, dict(r.values)) for r in read_records(path)] == [(r.step, dict(r.values)) for r in steps]
    rows = _read(tmp_path / "m.sparse.csv")
    assert rows[0] == list(SPARSE_FIELDS)
    assert rows[1] == ["r", "9", "0", "0", repr(evals[0].wall_time), "val_loss", repr(evals[0].values["val_loss"])]
    assert len(rows) == 1 + 2 + 2 + 2
    assert read_sparse_records(path) == [*evals, *late]  # exact floats, one record per log() call


def test_appending_continues_the_sparse_sidecar_without_a_second_header(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    rng = random.Random(46)
    first, second = make_sparse("a", [3], rng), make_sparse("b", [5], rng, names=("val_bleu",))
    sink = CSV(path)
    sink.write(first)
    sink.close()
    sink = CSV(path)
    sink.write(make_records("b", range(2), ["loss"], rng), make_skips("b", [1]))
    sink.write(second)
    sink.close()
    assert sum(row == list(SPARSE_FIELDS) for row in _read(sparse_path(path))) == 1
    assert read_sparse_records(path) == [*first, *second]
    assert [(e.step, e.kind.value) for e in read_events(path)] == [(1, "skip")]
    assert read_sparse_records(tmp_path / "none.csv") == []
