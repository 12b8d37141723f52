"""``bt.sinks.MLflow``: real training runs sent to a real MLflow SQLite tracking store and read back
with ``MlflowClient`` (``get_metric_history``, params, tags, status); the store taken away and
brought back mid-run; resume; odd names; the sink thread."""

from __future__ import annotations

import math
import os
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import batchtap as bt
from batchtap.errors import ConfigError
from batchtap.records import Event, Record, RunInfo, RunStatus
from batchtap.sinks.resilient import ResilientSink
from tests.conftest import ListSink
from tests.store._helpers import ODD_NAMES, make_records, make_run, make_sparse

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from batchtap.sinks.mlflow import RUN_ID_TAG, MLflow, mlflow_key  # noqa: E402


def _uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def _history(client: MlflowClient, mid: str, key: str) -> list[tuple[int, float, int]]:
    return [(m.step, m.value, m.timestamp) for m in client.get_metric_history(mid, key)]


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _train(tap: bt.Tap, steps: range, *, nan_at: int = -1, log_every: int = 0) -> None:
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for s in steps:
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tap.step(loss=loss * math.nan if s == nan_at else loss, outputs=out, targets=y)
        if log_every and s % log_every == log_every - 1:
            tap.log({"val_loss": loss.detach() * 0.5, "val/acc@1": 0.25})


def _check_against(client: MlflowClient, mid: str, seen: ListSink, *, prefix: str = "") -> None:
    """Every value the ListSink got is in MLflow at its step and wall time (ms), nothing else."""
    want: dict[str, list[tuple[int, float, int]]] = {}
    for r in seen.records:
        for name, v in r.values.items():
            key = mlflow_key(name if r.sparse else prefix + name)
            want.setdefault(key, []).append((r.step, v, int(r.wall_time * 1000)))
    for key, points in want.items():
        got = _history(client, mid, key)
        assert len(got) == len(points), key
        for (gs, gv, gt), (s, v, t) in zip(sorted(got), sorted(points), strict=True):
            assert (gs, gt) == (s, t) and _same(gv, v), (key, s)


def test_a_training_run_reads_back_from_mlflow(tmp_path: Path) -> None:
    uri = _uri(tmp_path)
    seen = ListSink()
    config = {"lr": 0.05, "model": {"layers": 2, "act": "relu"}, "tags": ["a", "b"]}
    with bt.Tap(sinks=[MLflow(uri, experiment="exp-1", prefix="train/"), seen], flush_every=4, nan_guard=False) as tap:
        with tap.run("mlflow-run", config=config) as info:
            _train(tap, range(18), nan_at=5, log_every=6)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("exp-1")
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    mid = run.info.run_id
    assert run.info.run_name == "mlflow-run" and run.data.tags[RUN_ID_TAG] == info.id
    assert run.info.status == "FINISHED" and run.data.tags["batchtap.status"] == "finished"
    assert run.data.params == {"lr": "0.05", "model.layers": "2", "model.act": "relu", "tags": '["a", "b"]'}
    assert run.info.end_time is not None and run.info.end_time >= run.info.start_time == int(info.started_at * 1000)
    _check_against(client, mid, seen, prefix="train/")
    assert "train/loss" in run.data.metrics and "val/acc_1" in run.data.metrics  # logged names as logged, made valid
    assert math.isnan(_history(client, mid, "train/loss")[5][1])  # the NaN step stays NaN
    assert [(s, v) for s, v, _ in _history(client, mid, "batchtap/anomalies")] == [(5, 1.0)]


def test_a_failed_run_is_failed_in_mlflow_with_every_step(tmp_path: Path) -> None:
    uri = _uri(tmp_path)
    seen = ListSink()
    with bt.Tap(sinks=[MLflow(uri), seen], flush_every=50) as tap:
        with pytest.raises(RuntimeError, match="boom"), tap.run("fails"):
            _train(tap, range(7))
            raise RuntimeError("boom")
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("batchtap").experiment_id])  # type: ignore[union-attr]
    assert run.info.status == "FAILED" and run.data.tags["batchtap.stop_reason"] == "RuntimeError: boom"
    assert [s for s, _, _ in _history(client, run.info.run_id, "loss")] == list(range(7))
    _check_against(client, run.info.run_id, seen)


def test_tracking_store_away_mid_run_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tracking database disappears (its path becomes a directory: every connection fails) for
    part of the run; with spool_dir the blocks wait on disk and reach MLflow once it is back."""
    monkeypatch.setenv("MLFLOW_SQLALCHEMYSTORE_POOLCLASS", "NullPool")  # a connection per request
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    seen = ListSink()
    with bt.Tap(sinks=[MLflow(uri), seen], flush_every=5, spool_dir=tmp_path / "spool") as tap:
        resilient = tap.sinks[0]
        assert isinstance(resilient, ResilientSink)
        with tap.run("outage"):
            _train(tap, range(10), log_every=5)
            tap.flush()
            assert not resilient.pending
            os.rename(db, tmp_path / "away.db")
            db.mkdir()  # sqlite cannot open a directory: the store is unreachable
            _train(tap, range(10, 20), log_every=5)
            tap.flush()
            assert resilient.pending and resilient.spooled >= 1  # really went to the spool
            db.rmdir()
            os.rename(tmp_path / "away.db", db)
            _train(tap, range(20, 30), log_every=5)
    assert not resilient.pending and resilient.replayed >= 1
    warnings = [e.message for e in seen.events if e.kind.value == "warning"]
    assert any("sink MLflow failed" in m and "nothing is lost" in m for m in warnings)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("batchtap").experiment_id])  # type: ignore[union-attr]
    assert run.info.status == "FINISHED"
    steps = [r for r in seen.records if not r.sparse]
    assert (
        [s for s, _, _ in sorted(_history(client, run.info.run_id, "loss"))]
        == [r.step for r in steps]
        == list(range(30))
    )
    _check_against(client, run.info.run_id, seen)


def test_a_resumed_run_continues_the_same_mlflow_run(tmp_path: Path) -> None:
    uri = _uri(tmp_path)
    store = tmp_path / "bt.db"
    with bt.Tap(sinks=[bt.sinks.SQLite(store), MLflow(uri)], flush_every=3) as tap:
        with pytest.raises(KeyError), tap.run("long", config={"lr": 0.1}) as first:
            _train(tap, range(6))
            raise KeyError("crash")
    with bt.Tap(sinks=[bt.sinks.SQLite(store), MLflow(uri)], flush_every=3) as tap:
        with tap.run(resume=first.id):
            _train(tap, range(4))
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("batchtap").experiment_id])  # type: ignore[union-attr]
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert [s for s, _, _ in _history(client, run.info.run_id, "loss")] == list(range(10))  # steps go on


class _Where(MLflow):
    """The real sink, noting the thread of each call the pipeline makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads: set[str] = set()

    def start_run(self, run: RunInfo) -> None:
        self.threads.add(threading.current_thread().name)
        super().start_run(run)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        self.threads.add(threading.current_thread().name)
        super().write(records, events)

    def end_run(self, run: RunInfo) -> None:
        self.threads.add(threading.current_thread().name)
        super().end_run(run)


def test_requests_run_on_the_sink_thread_only(tmp_path: Path) -> None:
    sink = _Where(_uri(tmp_path))
    with bt.Tap(sinks=[sink], flush_every=2) as tap, tap.run("threads") as info:
        _train(tap, range(6), log_every=3)
    assert sink.threads == {"batchtap-sink-_Where"}
    assert sink.mlflow_run_id(info.id) is not None


def test_odd_names_ranks_and_big_blocks(tmp_path: Path) -> None:
    uri = _uri(tmp_path)
    run = make_run()
    rng = random.Random(5)
    records = make_records(run.id, range(600), list(ODD_NAMES[:3]), rng)  # 1,800 values: two requests
    sink = MLflow(uri, experiment="odd")
    sink.start_run(run)
    sink.write(records + make_records(run.id, range(2), ["loss"], rng, rank=3))
    sink.write(make_sparse(run.id, [599], rng, names=ODD_NAMES[3:5]))
    sink.end_run(
        RunInfo(
            run.id,
            run.name,
            {},
            run.started_at,
            status=RunStatus.STOPPED,
            ended_at=run.started_at + 5,
            stop_reason="rule",
        )
    )
    client = MlflowClient(uri)
    mid = sink.mlflow_run_id(run.id)
    assert mid is not None
    got = client.get_run(mid)
    assert got.info.status == "KILLED" and got.data.tags["batchtap.status"] == "stopped"
    assert set(got.data.metrics) == {mlflow_key(n) for n in ODD_NAMES[:5]} | {"loss/rank3"}
    for name in ODD_NAMES[:3]:
        assert [v for _, v, _ in sorted(_history(client, mid, mlflow_key(name)))] == [r.values[name] for r in records]
    assert mlflow_key("semi;colon -- DROP TABLE metrics") == "semi_colon -- DROP TABLE metrics"


def test_bad_experiment_is_refused() -> None:
    with pytest.raises(ConfigError, match="experiment must be a non-empty name, got ''"):
        MLflow("sqlite:///x.db", experiment="")


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)  # as if mlflow were not installed
    with pytest.raises(ImportError, match=r"pip install 'batchtap\[mlflow\]'"):
        MLflow("sqlite:///x.db")
