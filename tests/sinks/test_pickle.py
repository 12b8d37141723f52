"""Every built-in sink travels as ``bt.Tap(pipeline="process")`` sends it: made here as a user makes
it, pickled, unpickled in a spawned process and driven through a run there; what it stored is read
back here. A sink pickled after this process used it goes on where it was, in the other process.

One spawned worker serves the whole module (each start imports torch): it keeps the unpickled
sinks, and the tests call them by key (``tests/sinks/_pickle_child.py``).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import pickle
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

import batchtap.store
from batchtap.errors import SinkError
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks.base import Sink
from batchtap.sinks.console import Console, format_sparse, format_values
from batchtap.sinks.csv import CSV, read_events, read_records, read_sparse_records
from batchtap.sinks.jsonl import JSONL
from batchtap.sinks.resilient import ResilientSink
from batchtap.sinks.sqlite import SQLite
from tests.sinks import _pickle_child as child
from tests.store._helpers import PG_DSN, make_records, make_run, make_sparse, pg_schema_fixture


# -- the worker ---------------------------------------------------------------------------------
class Worker:
    """A process started with the ``spawn`` start method, as the pipeline process is."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._pool.apply_async(fn, args).get(timeout=120)

    def send(self, sink: Sink) -> Remote:
        """Pickle ``sink`` here and unpickle it there."""
        return Remote(self, self(child.load, pickle.dumps(sink)))


@dataclass
class Remote:
    """A sink's copy in the worker."""

    worker: Worker
    key: int

    def __call__(self, method: str, *args: Any) -> Any:
        return self.worker(child.call, self.key, method, *args)

    def attr(self, name: str) -> Any:
        return self.worker(child.attr, self.key, name)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        yield Worker(pool)


@pytest.fixture
def pg_schema() -> Iterator[str]:
    yield from pg_schema_fixture()


# -- the run ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    info: RunInfo
    first: list[Record]  # the first block
    second: list[Record]  # the second block: two steps and a value logged with Tap.log()
    events: list[Event]  # sent with the second block

    @property
    def ended(self) -> RunInfo:
        return replace(self.info, status=RunStatus.FINISHED, ended_at=self.info.started_at + 9.0)

    @property
    def steps(self) -> list[Record]:
        return [r for r in self.first + self.second if not r.sparse]

    @property
    def logged(self) -> list[Record]:
        return [r for r in self.second if r.sparse]


def _run(seed: int) -> Run:
    import random

    rng = random.Random(seed)
    info = make_run(name="pickled")
    steps = make_records(info.id, range(4), ["loss", "acc"], rng)
    logged = make_sparse(info.id, [3], rng, names=("val_loss",))
    anomaly = Event(
        info.id, 2, EventKind.ANOMALY, "acc 1.5 outside [0, 1]", steps[2].wall_time, metric="acc", raw_value=1.5
    )
    return Run(info, steps[:2], [*steps[2:], *logged], [anomaly])


def _begin(remote: Remote, run: Run) -> None:
    remote("start_run", run.info)
    remote("write", run.first)


def _finish(remote: Remote, run: Run) -> None:
    remote("write", run.second, run.events)
    remote("end_run", run.ended)
    remote("flush")
    remote("close")


# -- reading back -------------------------------------------------------------------------------
def _check_store(st: batchtap.store.Store, run: Run) -> None:
    row = st.run(run.info.id)
    assert (row.name, row.status, row.ended_at, row.config) == (
        "pickled",
        RunStatus.FINISHED,
        run.ended.ended_at,
        run.info.config,
    )
    for metric in ("loss", "acc"):
        got = [(p.step, p.value, p.wall_time, p.epoch, p.batch) for p in st.series(run.info.id, metric)]
        assert got == [(r.step, r.values[metric], r.wall_time, r.epoch, r.batch) for r in run.steps]
    assert st.sparse_records(run.info.id) == run.logged
    assert st.events(run.info.id) == run.events


def _make_sqlite(tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    return SQLite(tmp_path / "runs" / "bt.db")


def _check_sqlite(sink: Sink, remote: Remote, run: Run) -> None:
    assert isinstance(sink, SQLite)
    with batchtap.store.open(sink.path) as st:
        _check_store(st, run)
    # the training process's own copy still answers for resume, from what the other one stored
    assert (sink.last_step(run.info.id), sink.run_name(run.info.id)) == (3, "pickled")


def _make_postgres(tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    from batchtap.sinks.postgres import Postgres

    return Postgres(PG_DSN, schema=request.getfixturevalue("pg_schema"))


def _check_postgres(sink: Sink, remote: Remote, run: Run) -> None:
    from batchtap.sinks.postgres import Postgres

    assert isinstance(sink, Postgres)
    with batchtap.store.open(PG_DSN, schema=sink.schema) as st:
        _check_store(st, run)
    assert (sink.last_step(run.info.id), sink.run_name(run.info.id)) == (3, "pickled")


def _make_jsonl(tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    return JSONL(tmp_path / "logs" / "m.jsonl")


def _check_jsonl(sink: Sink, remote: Remote, run: Run) -> None:
    assert isinstance(sink, JSONL)
    lines = [json.loads(line) for line in sink.path.read_text().splitlines()]
    assert [line["type"] for line in lines] == ["run_start", *["record"] * 5, "event", "run_end"]
    records = [line for line in lines if line["type"] == "record"]
    got = [
        (line["step"], line["wall_time"], line.get("sparse", False), {k: line[k] for k in r.values})
        for line, r in zip(records, run.first + run.second)
    ]
    assert got == [(r.step, r.wall_time, r.sparse, dict(r.values)) for r in run.first + run.second]
    (event,) = [line for line in lines if line["type"] == "event"]
    assert (event["step"], event["kind"], event["message"], event["raw_value"]) == (
        2,
        "anomaly",
        run.events[0].message,
        1.5,
    )
    assert lines[-1]["status"] == "finished" and lines[0]["run_id"] == run.info.id


def _make_csv(tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    return CSV(tmp_path / "csv" / "metrics.csv")


def _check_csv(sink: Sink, remote: Remote, run: Run) -> None:
    assert isinstance(sink, CSV)
    assert read_records(sink.path) == run.steps
    assert read_sparse_records(sink.path) == run.logged
    assert read_events(sink.path) == run.events


def _make_tensorboard(tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    pytest.importorskip("tensorboard")
    from batchtap.sinks.tensorboard import TensorBoard

    return TensorBoard(tmp_path / "tb")


def _check_tensorboard(sink: Sink, remote: Remote, run: Run) -> None:
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from batchtap.sinks.tensorboard import TensorBoard

    assert isinstance(sink, TensorBoard)
    acc = EventAccumulator(str(sink.log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()  # every event file of the directory: one per process that wrote
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/acc", "val_loss"}
    for metric in ("loss", "acc"):
        got = sorted((e.step, e.wall_time, e.value) for e in acc.Scalars(f"train/{metric}"))
        assert got == [(r.step, r.wall_time, float(np.float32(r.values[metric]))) for r in run.steps]
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [
        (3, float(np.float32(run.logged[0].values["val_loss"])))
    ]
    (anomaly,) = acc.Tensors("events/anomaly/text_summary")
    assert anomaly.step == 2 and "acc 1.5 outside [0, 1]" in anomaly.tensor_proto.string_val[0].decode()
    assert acc.Tensors("run/status/text_summary")[0].tensor_proto.string_val[0].decode() == "finished"


def _make_mlflow(tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    pytest.importorskip("mlflow")
    from batchtap.sinks.mlflow import MLflow

    return MLflow(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="pickled")


def _check_mlflow(sink: Sink, remote: Remote, run: Run) -> None:
    from mlflow.tracking import MlflowClient

    from batchtap.sinks.mlflow import RUN_ID_TAG, MLflow

    assert isinstance(sink, MLflow)
    client = MlflowClient(sink.tracking_uri)
    experiment = client.get_experiment_by_name("pickled")
    assert experiment is not None
    (got,) = client.search_runs([experiment.experiment_id])  # one MLflow run, whoever started it
    assert got.info.run_id == remote("mlflow_run_id", run.info.id)
    assert (got.info.status, got.info.run_name, got.data.tags[RUN_ID_TAG]) == ("FINISHED", "pickled", run.info.id)
    assert got.data.params == {"lr": "0.1", "layers": "[3, 4]", "note": "ünïcode"}

    def history(key: str) -> list[tuple[int, float, int]]:
        return [(m.step, m.value, m.timestamp) for m in client.get_metric_history(got.info.run_id, key)]

    for metric in ("loss", "acc"):
        assert history(metric) == [(r.step, r.values[metric], int(r.wall_time * 1000)) for r in run.steps]
    (logged,) = run.logged
    assert history("val_loss") == [(3, logged.values["val_loss"], int(logged.wall_time * 1000))]
    assert [(s, v) for s, v, _ in history("batchtap/anomalies")] == [(2, 1.0)]


def _make_resilient(tmp_path: Path, request: pytest.FixtureRequest) -> Sink:
    return ResilientSink(SQLite(tmp_path / "bt.db"), spool_path=tmp_path / "spool" / "sqlite.jsonl")


def _check_resilient(sink: Sink, remote: Remote, run: Run) -> None:
    assert isinstance(sink, ResilientSink) and isinstance(sink.sink, SQLite)
    with batchtap.store.open(sink.sink.path) as st:
        _check_store(st, run)
    assert not sink.pending and remote.attr("spooled") == 0
    assert sink.last_step(run.info.id) == 3


@dataclass(frozen=True)
class Case:
    make: Callable[[Path, pytest.FixtureRequest], Sink]
    check: Callable[[Sink, Remote, Run], None]


STORES = [
    pytest.param(Case(_make_sqlite, _check_sqlite), id="sqlite"),
    pytest.param(Case(_make_postgres, _check_postgres), id="postgres"),
    pytest.param(Case(_make_jsonl, _check_jsonl), id="jsonl"),
    pytest.param(Case(_make_csv, _check_csv), id="csv"),
    pytest.param(Case(_make_tensorboard, _check_tensorboard), id="tensorboard"),
    pytest.param(Case(_make_mlflow, _check_mlflow), id="mlflow"),
    pytest.param(Case(_make_resilient, _check_resilient), id="resilient-sqlite"),
]


@pytest.mark.parametrize("used_here", [False, True], ids=["unused", "used-here-first"])
@pytest.mark.parametrize("case", STORES)
def test_a_sink_unpickled_in_a_spawned_process_stores_the_run_there(
    case: Case, used_here: bool, worker: Worker, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Unused: the whole run goes through the copy. Used here first: this process starts the run
    and writes the first block, then pickles the sink; the copy writes the rest. Either way the
    store holds exactly the run, and this process's copy still works."""
    run = _run(seed=40)
    sink = case.make(tmp_path, request)
    try:
        if used_here:
            sink.start_run(run.info)
            sink.write(run.first)
        remote = worker.send(sink)
        if not used_here:
            _begin(remote, run)
        _finish(remote, run)
        case.check(sink, remote, run)
    finally:
        sink.close()


# -- Console ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", ["stderr", "stdout"])
def test_the_console_prints_to_the_std_stream_of_the_process_that_unpickled_it(stream: str, worker: Worker) -> None:
    run = _run(seed=41)
    # as a user makes it: stderr by default, or stdout by name
    sink = Console(every=1, live=False) if stream == "stderr" else Console(every=1, live=False, stream=sys.stdout)
    calls = [
        ("start_run", (run.info,)),
        ("write", (run.first,)),
        ("write", (run.second, run.events)),
        ("end_run", (run.ended,)),
        ("flush", ()),
        ("close", ()),
    ]
    out, err = worker(child.with_own_std_streams, pickle.dumps(sink), calls)
    got, other = (err, out) if stream == "stderr" else (out, err)
    steps, (logged,) = run.steps, run.logged
    assert got.splitlines() == [
        f"batchtap: run 'pickled' ({run.info.id[:8]}) started",
        *[f"epoch 0 batch {r.batch}: {format_values(r.values)}" for r in steps[:2]],
        "batchtap anomaly at step 2: acc 1.5 outside [0, 1]",
        *[f"epoch 0 batch {r.batch}: {format_values(r.values)}" for r in steps[2:]],
        format_sparse(logged),
        f"batchtap: run 'pickled' finished: 4 steps, last: {format_values(steps[-1].values)}; anomalies: 1",
    ]
    assert other == ""


def test_a_console_on_another_stream_cannot_travel_and_says_what_to_do() -> None:
    buffer = io.StringIO()
    sink = Console(every=1, live=False, stream=buffer)
    with pytest.raises(
        TypeError,
        match=r"bt\.sinks\.Console cannot be pickled into another process \(pipeline='process'\) with "
        r"stream=<_io\.StringIO .*>: expected sys\.stdout or sys\.stderr, .*got another stream; fix: leave stream= "
        r"unset \(sys\.stderr\) or pass sys\.stdout, or use pipeline='thread'",
    ):
        pickle.dumps(sink)
    run = _run(seed=42)
    sink.start_run(run.info)  # still the sink it was, here
    sink.close()
    assert buffer.getvalue().startswith("batchtap: run 'pickled'")


# -- W&B ----------------------------------------------------------------------------------------
def test_wandb_runs_are_opened_by_the_process_that_unpickled_the_sink(worker: Worker, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from batchtap.sinks.wandb import STEP_KEY, WandB
    from tests.sinks._wandb_file import read_run

    run = _run(seed=43)
    sink = WandB(project="bt-pickle", mode="offline", dir=tmp_path, prefix="train/")
    remote = worker.send(sink)
    _begin(remote, run)
    _finish(remote, run)
    worker(child.wandb_teardown)  # the worker's wandb service wrote every file
    (path,) = remote.attr("files")[run.info.id]
    assert sink.files == {}  # this process opened no W&B run
    got = read_run(path)
    assert (got.run_id, got.name, got.project, got.exit_code) == (run.info.id, "pickled", "bt-pickle", 0)
    assert got.config["lr"] == 0.1 and got.summary["batchtap/status"] == "finished"
    rows = [r for r in got.history if "train/loss" in r]
    assert [(r[STEP_KEY], r["_timestamp"], r["train/loss"], r["train/acc"]) for r in rows] == [
        (r.step, r.wall_time, r.values["loss"], r.values["acc"]) for r in run.steps
    ]
    (logged,) = run.logged
    assert [(r[STEP_KEY], r["val_loss"]) for r in got.history if "val_loss" in r] == [(3, logged.values["val_loss"])]
    assert [(r[STEP_KEY], r["batchtap/anomalies"]) for r in got.history if "batchtap/anomalies" in r] == [(2, 1)]


# -- Prometheus ---------------------------------------------------------------------------------
def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def _sample(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def test_prometheus_is_served_by_the_process_that_unpickled_it(worker: Worker) -> None:
    pytest.importorskip("prometheus_client")
    from batchtap.sinks.prometheus import Prometheus

    run = _run(seed=44)
    sink = Prometheus(port=0, addr="127.0.0.1")  # port 0: one is picked, and kept by the copy
    url = sink.url
    with pytest.raises(OSError):
        _scrape(url)  # this process never listens: the training process's copy only travels
    remote = worker.send(sink)
    assert remote.attr("url") == url
    _begin(remote, run)
    remote("write", run.second, run.events)
    labels = {"run": "pickled", "run_id": run.info.id}
    got = _scrape(url)  # from here, while the worker holds the run open
    last, (logged,) = run.steps[-1], run.logged
    assert _sample(got, "batchtap_step", **labels) == 3
    assert _sample(got, "batchtap_value", metric="loss", rank="0", **labels) == last.values["loss"]
    assert _sample(got, "batchtap_logged_value", metric="val_loss", **labels) == logged.values["val_loss"]
    assert _sample(got, "batchtap_events_total", kind="anomaly", metric="acc", **labels) == 1
    assert _sample(got, "batchtap_run_status", batchtap_run_status="running", **labels) == 1
    remote("end_run", run.ended)
    assert _sample(_scrape(url), "batchtap_run_status", batchtap_run_status="finished", **labels) == 1
    remote("close")
    with pytest.raises(OSError):
        _scrape(url)  # the port is free again


def test_prometheus_serving_here_keeps_its_port_until_closed(worker: Worker) -> None:
    """Pickled after it served here, the copy cannot listen while the original holds the port:
    its first call says so; once the original is closed, the copy serves."""
    pytest.importorskip("prometheus_client")
    from batchtap.sinks.prometheus import Prometheus

    run = _run(seed=45)
    sink = Prometheus(port=0, addr="127.0.0.1")
    sink.start_run(run.info)
    remote = worker.send(sink)
    with pytest.raises(SinkError, match=rf"cannot listen on 127\.0\.0\.1:{sink.port}: .*fix: pass another port="):
        remote("start_run", run.info)
    sink.close()
    remote("start_run", run.info)
    remote("write", run.first)
    got = _scrape(sink.url)
    assert _sample(got, "batchtap_step", run="pickled", run_id=run.info.id) == 1
    remote("close")


def test_every_built_in_sink_is_checked_here() -> None:
    """A sink added to ``bt.sinks`` gets its case here (it must travel to the pipeline process too)."""
    import batchtap as bt

    checked = {"SQLite", "Postgres", "JSONL", "CSV", "TensorBoard", "MLflow", "Console", "WandB", "Prometheus"}
    checked.add("Webhook")  # tests/sinks/test_webhook.py: delivers from the pipeline process
    assert set(bt.sinks.__all__) - {"Sink"} == checked
