"""Issue 29 item 4: every reader method takes what ``Store.run()`` takes (id, unique id prefix,
name, a ``RunRow``) and answers a mistake with the same clear errors, never ``[]``; on SQLite and
PostgreSQL."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import batchtap.store
from batchtap.sinks.base import Sink
from batchtap.sinks.sqlite import SQLite
from batchtap.store import MetricNotFound, RunNotFound, Store
from tests.store._helpers import PG_DSN, make_events, make_records, make_run, make_sparse, pg_schema_fixture

Backend = tuple[Callable[[], Sink], Callable[[], Store]]


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        path = tmp_path / "bt.db"
        make_sink: Callable[[], Sink] = lambda: SQLite(path)  # noqa: E731
        opener: Callable[[], Store] = lambda: batchtap.store.open(f"sqlite:///{path}")  # noqa: E731
        yield from _filled(make_sink, opener)
        return
    from batchtap.sinks.postgres import Postgres

    for schema in pg_schema_fixture():
        yield from _filled(lambda: Postgres(PG_DSN, schema=schema), lambda: batchtap.store.open(PG_DSN, schema=schema))


def _filled(make_sink: Callable[[], Sink], opener: Callable[[], Store]) -> Iterator[Store]:
    rng = random.Random(4)
    sink = make_sink()
    run = make_run("c0ffee11aa", name="alpha")
    other = make_run("c0ffee22bb", name="beta", started_at=1_700_000_100.0)
    for r in (run, other):
        sink.start_run(r)
        sink.write(make_records(r.id, range(5), ["loss", "acc"], rng), make_events(r.id))
        sink.write(make_sparse(r.id, [2, 4], rng))
    sink.close()
    with opener() as st:
        yield st


REFS = {
    "id": lambda st: "c0ffee11aa",
    "prefix": lambda st: "c0ffee1",
    "name": lambda st: "alpha",
    "RunRow": lambda st: st.run("alpha"),
}


@pytest.mark.parametrize("ref", sorted(REFS))
def test_every_reader_method_takes_what_run_takes(store: Store, ref: str) -> None:
    given = REFS[ref](store)
    by_id = "c0ffee11aa"
    assert store.run(given).id == by_id
    assert store.series(given, "loss") == store.series(by_id, "loss") and len(store.series(given, "loss")) == 5
    assert repr(store.events(given)) == repr(store.events(by_id)) and store.events(given)  # NaN raw values
    assert store.metric_names(given) == store.metric_names(by_id) == ["loss", "acc", "val_acc", "val_loss"]
    assert store.sparse_names(given) == ["val_acc", "val_loss"]
    assert store.sparse_records(given) == store.sparse_records(by_id) and len(store.sparse_records(given)) == 2
    assert repr(list(store.iter_metrics(given))) == repr(list(store.iter_metrics(by_id)))


@pytest.mark.parametrize(
    "call",
    ["series", "events", "metric_names", "sparse_names", "sparse_records", "iter_metrics"],
)
def test_an_unknown_run_raises_run_not_found_with_the_closest_names(store: Store, call: str) -> None:
    method = getattr(store, call)
    args = ("alpah", "loss") if call == "series" else ("alpah",)
    with pytest.raises(RunNotFound, match=r"no run 'alpah' in .*closest: 'alpha'") as info:
        result = method(*args)
        if call == "iter_metrics":
            list(result)
    assert info.value.candidates[0] == "alpha"


def test_an_ambiguous_prefix_is_an_error(store: Store) -> None:
    with pytest.raises(RunNotFound, match=r"run id prefix 'c0ffee' is ambiguous .* c0ffee11aa, c0ffee22bb"):
        store.series("c0ffee", "loss")


def test_a_misspelled_metric_raises_with_the_closest_names(store: Store) -> None:
    with pytest.raises(MetricNotFound, match=r"run 'alpha' \(c0ffee11\) has no metric 'los' .*closest: 'loss'"):
        store.series("alpha", "los")
    with pytest.raises(MetricNotFound, match=r"no metric 'val_los' logged with tap.log\(\).*closest: 'val_loss'"):
        store.sparse_records("alpha", ["val_los"])
    assert isinstance(MetricNotFound("x", ref="x"), LookupError)


def test_a_declared_metric_without_values_is_an_empty_series(store: Store) -> None:
    # make_run declares ("loss", "acc"); a rank with no rows of a present metric is empty too
    assert store.series("alpha", "loss", rank=7) == []


def test_a_wrong_type_names_what_is_expected(store: Store) -> None:
    with pytest.raises(TypeError, match=r"a run must be given as its id, unique id prefix or name \(str\)"):
        store.series(42, "loss")  # type: ignore[arg-type]
