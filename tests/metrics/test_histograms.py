"""Histograms against numpy.histogram with the same edges (weights after the step, gradients as the
step used them, unscaled under a GradScaler), every N-th step only, no host read."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from batchtap.errors import ConfigError
from batchtap.hostreads import HostReadCounter
from batchtap.metrics.histograms import Histograms, histogram, histogram_edges
from batchtap.metrics.layers import layer_groups
from tests.conftest import ListSink
from tests.store._helpers import PG_DSN, pg_schema_fixture

BINS = 16


def _numpy(tensors: list[torch.Tensor], bins: int = BINS) -> tuple[float, float, list[float]]:
    flat = np.concatenate([t.detach().double().reshape(-1).numpy() for t in tensors])
    counts, _ = np.histogram(flat, bins=histogram_edges(flat.min(), flat.max(), bins))
    return float(flat.min()), float(flat.max()), counts.astype(float).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_histogram_equals_numpy_with_the_same_edges(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(37, 11, generator=g), torch.rand(50, generator=g) * 3]
    got = histogram(tensors, BINS).tolist()
    low, high, counts = _numpy(tensors)
    assert got[0] == pytest.approx(low) and got[1] == pytest.approx(high)
    assert got[2:] == counts
    assert sum(got[2:]) == 37 * 11 + 50


def _values(record, kind: str, layer: str) -> tuple[float, float, list[float]]:
    v = record.values
    prefix = f"hist/{kind}/{layer}/"
    return v[prefix + "min"], v[prefix + "max"], [v[f"{prefix}{i}"] for i in range(BINS)]


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "GradScaler"])
def test_loop_histograms_equal_numpy_on_every_nth_step(sink: ListSink, amp: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if amp else None
    groups = layer_groups(model)
    tap = bt.Tap([bt.metrics.Loss(), Histograms(model, every=3, bins=BINS, scaler=scaler)], [sink], flush_every=4)
    g = torch.Generator().manual_seed(1)
    expected = {}
    reads = HostReadCounter()
    with tap, tap.run(name="hist"):
        for step in range(9):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            if scaler is None:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                grads = {k: _numpy([p.grad for p in ps]) for k, ps in groups.items()}
                opt.step()
            else:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                grads = {k: _numpy([p.grad for p in ps]) for k, ps in groups.items()}
                scaler.step(opt)
                scaler.update()
            if step % 3 == 0:
                expected[step] = (grads, {k: _numpy(list(ps)) for k, ps in groups.items()})
            if step == 0:
                tap.step(loss=loss)
                continue
            with reads:
                tap.step(loss=loss)
    assert reads.count == 0, reads.reads
    by_step = {r.step: r for r in sink.records}
    for step, record in by_step.items():
        names = [n for n in record.values if n.startswith("hist/")]
        if step not in expected:
            assert names == []
            continue
        assert len(names) == 2 * 2 * (BINS + 2)
        grads, weights = expected[step]
        for layer in groups:
            for kind, want in (("weight", weights[layer]), ("grad", grads[layer])):
                low, high, counts = _values(record, kind, layer)
                assert (low, high) == pytest.approx(want[:2], rel=1e-5)
                assert counts == want[2], (step, kind, layer)


def test_bad_arguments() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"bins must be an int in \[2, 512\], got 1"):
        Histograms(model, bins=1)
    with pytest.raises(ConfigError, match="every must be an int >= 1, got 0"):
        Histograms(model, every=0)


@pytest.fixture
def pg_schema() -> Iterator[str]:
    yield from pg_schema_fixture()


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_stores_keep_one_row_per_layer_kind_and_captured_step(tmp_path: Path, store: str, request) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = layer_groups(model)
    if store == "sqlite":
        sink = bt.sinks.SQLite(tmp_path / "h.db")
    else:
        schema = request.getfixturevalue("pg_schema")
        sink = bt.sinks.Postgres(PG_DSN, schema=schema)
    tap = bt.Tap([bt.metrics.Loss(), Histograms(model, every=2, bins=BINS)], [sink], flush_every=3)
    weights = {}
    with tap, tap.run(name="hist-store") as run:
        for step in range(5):
            opt.zero_grad()
            loss = F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,)))
            loss.backward()
            opt.step()
            if step % 2 == 0:
                weights[step] = {k: _numpy(list(ps)) for k, ps in groups.items()}
            tap.step(loss=loss)
    run_id = run.id
    query = "SELECT kind, layer, step, low, high, counts FROM histograms WHERE run_id = {p} ORDER BY step, kind, layer"
    names = "SELECT DISTINCT metric FROM metrics WHERE run_id = {p}"
    if store == "sqlite":
        with sqlite3.connect(tmp_path / "h.db") as conn:
            rows = conn.execute(query.format(p="?"), (run_id,)).fetchall()
            stored_names = {r[0] for r in conn.execute(names.format(p="?"), (run_id,))}
    else:
        import psycopg

        with psycopg.connect(PG_DSN, options=f"-c search_path={schema}") as conn:
            rows = conn.execute(query.format(p="%s"), (run_id,)).fetchall()
            stored_names = {r[0] for r in conn.execute(names.format(p="%s"), (run_id,))}
    assert stored_names == {"loss"}  # no histogram value in the long-form table
    assert [(k, la, s) for k, la, s, *_ in rows] == [
        (kind, layer, step) for step in (0, 2, 4) for kind in ("grad", "weight") for layer in ("0", "2")
    ]
    for kind, layer, step, low, high, counts in rows:
        assert len(json.loads(counts)) == BINS
        if kind == "weight":
            want = weights[step][layer]
            assert (low, high) == pytest.approx(want[:2], rel=1e-5)
            assert json.loads(counts) == want[2]


def test_export_csv_writes_the_histograms_beside_the_values(tmp_path: Path) -> None:
    from batchtap.cli.main import main as cli

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    db = tmp_path / "h.db"
    tap = bt.Tap([bt.metrics.Loss(), Histograms(model, every=2, bins=4)], [bt.sinks.SQLite(db)], flush_every=2)
    with tap, tap.run(name="hist-export"):
        for _ in range(4):
            opt.zero_grad()
            loss = model(torch.randn(3, 5)).pow(2).mean()
            loss.backward()
            opt.step()
            tap.step(loss=loss)
    out = tmp_path / "x.csv"
    assert cli(["export", "hist-export", "--db", str(db), "--format", "csv", "-o", str(out)]) == 0
    lines = (tmp_path / "x.histograms.csv").read_text().splitlines()
    assert lines[0] == "run_id,kind,layer,step,rank,low,high,bin0,bin1,bin2,bin3"
    rows = [line.split(",") for line in lines[1:]]
    assert [(r[1], r[2], r[3]) for r in rows] == [
        (kind, layer, step) for kind in ("grad", "weight") for layer in ("0", "2") for step in ("0", "2")
    ]
    weights = sum(p.numel() for p in model[2].parameters())
    assert all(sum(float(c) for c in r[7:]) == weights for r in rows if r[1] == "weight" and r[2] == "2")
    assert "hist/" not in out.read_text()  # the long-form values carry no histogram column


def test_other_values_under_hist_stay_ordinary_metric_rows() -> None:
    from batchtap.records import Record
    from batchtap.store.schema import histogram_rows, metric_rows

    values = {"hist/my_value": 1.0, "hist/a/b": 2.0, "hist/grad/fc/0": 3.0, "hist/grad/fc/min": 0.0}
    record = Record("r", step=1, epoch=0, batch=1, rank=0, wall_time=0.0, values=values)
    assert [row[1] for row in metric_rows([record])] == ["hist/my_value", "hist/a/b"]
    assert [(row[1], row[2], row[-1]) for row in histogram_rows([record])] == [("grad", "fc", "[3.0]")]
