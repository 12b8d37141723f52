"""``Store.frame()``: a run as a wide pandas DataFrame, on SQLite and PostgreSQL, compared with the
records the sinks were given (step values, NaN, ``Tap.log()`` values, ranks, clashing names)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import batchtap as bt
import batchtap.store
from batchtap.records import ALL_RANKS, Record
from batchtap.sinks.base import Sink
from batchtap.sinks.sqlite import SQLite
from batchtap.store import RunNotFound, Store, StoreError
from tests.conftest import ListSink
from tests.store._helpers import PG_DSN, make_records, make_run, make_sparse, pg_schema_fixture

pd = pytest.importorskip("pandas")

Backend = tuple[Callable[[], Sink], Callable[[], Store]]


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "sqlite":
        path = tmp_path / "bt.db"
        yield (lambda: SQLite(path)), (lambda: batchtap.store.open(path))
        return
    from batchtap.sinks.postgres import Postgres

    for schema in pg_schema_fixture():
        yield (lambda: Postgres(PG_DSN, schema=schema)), (lambda: batchtap.store.open(PG_DSN, schema=schema))


def _reference(records: list[Record], rank: int) -> dict[str, dict[int, float]]:
    """metric -> step -> value, from the records as given to the sink (the hand-made pivot)."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        if r.rank == rank:
            for name, v in r.values.items():
                out.setdefault(name, {})[r.step] = v
    return out


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_frame_is_the_pivot_of_the_records_with_logged_values(backend: Backend) -> None:
    make_sink, open_store = backend
    rng = random.Random(7)
    run = make_run()
    steps = make_records(run.id, range(40), ["loss", "acc"], rng, nan_every=9)
    sparse = make_sparse(run.id, [9, 19, 39], rng) + make_sparse(run.id, [45], rng, names=("bleu",))
    sink = make_sink()
    sink.start_run(run)
    sink.write([*steps[:20], sparse[0], sparse[1]])
    sink.write([*steps[20:], sparse[2], sparse[3]])
    sink.close()
    with open_store() as st:
        frame = st.frame(run.name)
        ref = _reference([*steps, *sparse], rank=0)
        assert list(frame.columns) == ["loss", "acc", "bleu", "val_acc", "val_loss"]  # declared, then logged sorted
        assert frame.index.name == "step" and list(frame.index) == [*range(40), 45]  # 45: logged past the last step
        assert all(frame.dtypes == "float64")
        for name, col in frame.items():
            for step, got in col.items():
                want = ref[name].get(int(step), math.nan)  # NaN where nothing was stored at that step
                assert _same(got, want), (name, step)
        assert math.isnan(frame.loc[9, "loss"]) and frame.loc[9, "val_loss"] == ref["val_loss"][9]
        assert frame.attrs == {
            "run_id": run.id,
            "run_name": run.name,
            "sparse": ["bleu", "val_acc", "val_loss"],
            "rolled_back": [],
        }
        picked = st.frame(run.id[:6], ["val_loss", "loss"])  # by id prefix, in the order asked
        assert list(picked.columns) == ["val_loss", "loss"] and list(picked.index) == list(range(40))


def test_positions_and_a_logged_name_that_clashes_with_one(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = replace(make_run(), metrics=("loss",))
    sink = SQLite(path)
    sink.start_run(run)
    sink.write([Record(run.id, s, s // 4, s % 4, 0, 100.0 + s, {"loss": 1.0 + s}) for s in range(8)])
    sink.write([Record(run.id, 3, 0, -1, 0, 103.5, {"epoch": 0.0, "val_loss": 0.5}, sparse=True)])
    sink.write([Record(run.id, 9, 2, -1, 0, 110.0, {"epoch": 2.0}, sparse=True)])
    sink.close()
    with batchtap.store.open(path) as st:
        frame = st.frame(run.id, positions=True)
        plain = st.frame(run.id)
    assert list(frame.columns) == ["epoch", "batch", "wall_time", "loss", "metric:epoch", "val_loss"]
    assert list(plain.columns) == ["loss", "epoch", "val_loss"]  # no positions: the logged name as is
    assert frame.loc[3, ["epoch", "batch", "wall_time"]].tolist() == [0, 3, 103.0]  # from the step values
    assert frame.loc[9, ["epoch", "batch", "wall_time"]].tolist() == [2, -1, 110.0]  # only logged: the log()'s
    assert frame["epoch"].dtype == "int64" and frame["metric:epoch"].loc[9] == 2.0


def test_rank_picks_one_process_and_the_default_is_the_reduced_rows(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    rng = random.Random(3)
    run = replace(make_run(), metrics=("loss",))
    per_rank = {r: make_records(run.id, range(6), ["loss"], rng, rank=r) for r in (ALL_RANKS, 0, 1)}
    sink = SQLite(path)
    sink.start_run(run)
    for recs in per_rank.values():
        sink.write(recs)
    sink.close()
    with batchtap.store.open(path) as st:
        for rank, recs in per_rank.items():
            assert st.frame(run.id, rank=rank)["loss"].tolist() == [r.values["loss"] for r in recs]
        assert st.frame(run.id)["loss"].tolist() == [r.values["loss"] for r in per_rank[ALL_RANKS]]


def test_bad_names_and_runs_say_what_exists(tmp_path: Path) -> None:
    path = tmp_path / "bt.db"
    run = replace(make_run(), metrics=("loss",))
    sink = SQLite(path)
    sink.start_run(run)
    sink.write(make_records(run.id, range(3), ["loss"], random.Random(1)))
    sink.close()
    with batchtap.store.open(path) as st:
        with pytest.raises(StoreError, match=r"no values for 'lss'; it has loss; fix: pass metrics="):
            st.frame(run.id, ["lss"])
        with pytest.raises(RunNotFound, match="no run 'nope'"):
            st.frame("nope")
        assert st.frame(run.id, "loss").columns.tolist() == ["loss"]  # a lone name is one name
        empty = make_run()
        other = SQLite(path)
        other.start_run(empty)
        other.close()
        got = st.frame(empty.id)
        assert got.empty and got.index.name == "step"


def test_frame_of_a_real_training_run_equals_what_the_sinks_got(tmp_path: Path) -> None:
    """A Tap with tap.log() after each epoch, stored to SQLite; the frame holds exactly what a
    ListSink beside it received."""
    path = tmp_path / "bt.db"
    seen = ListSink()
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with bt.Tap(sinks=[SQLite(path), seen], optimizer=opt, model=model, flush_every=5) as tap:
        with tap.run("frame-real") as info:
            for epoch in range(3):
                for _ in range(7):
                    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
                    out = model(x)
                    loss = torch.nn.functional.cross_entropy(out, y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    tap.step(loss=loss, outputs=out, targets=y)
                tap.log({"val_loss": loss.detach() * 0.5, "epoch_done": float(epoch)})
    with batchtap.store.open(path) as st:
        frame = st.frame("frame-real")
    ref = _reference(seen.records, rank=0)
    assert set(frame.columns) == set(ref) and list(frame.index) == list(range(21))
    assert frame.attrs["sparse"] == ["epoch_done", "val_loss"] and info.id == frame.attrs["run_id"]
    for name, by_step in ref.items():
        col = frame[name]
        assert col.notna().sum() == len(by_step), name
        for step, v in by_step.items():
            assert _same(col.loc[step], v), (name, step)
    assert frame["epoch_done"].dropna().index.tolist() == [6, 13, 20]  # at the step each epoch ended
