"""The block decoder (pipeline/decode.py) against the row-by-row decoder it replaced: on blocks of
every built-in metric's raw columns, filled with awkward values (NaN, inf, negatives, zero counts,
out-of-range class indices, the host codes of GradNorm and LossScale), records, events, input
errors, weights and anomaly counts must be the same."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import batchtap as bt
from batchtap.capture.flush import BlockData
from batchtap.metrics import StepInputs
from batchtap.metrics.layout import Layout
from batchtap.pipeline.chain.decode import Decoder
from batchtap.pipeline.chain.rows import DecodedBlock
from tests.pipeline._row_decoder import RowDecoder

VALUES = [0.0, 1.0, 2.0, 0.5, 3.0, -1.0, 7.0, math.nan, math.inf, -math.inf, 1e9, 16.0]


def _metrics() -> list[bt.metrics.Metric]:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1)
    return [
        bt.metrics.Loss(),
        bt.metrics.Accuracy(topk=(1, 3)),
        bt.metrics.StepTime(),
        bt.metrics.DataTime(),
        bt.metrics.Throughput(),
        bt.metrics.LearningRate(opt),
        bt.metrics.GradNorm(model),
        bt.metrics.LossScale(torch.amp.GradScaler("cpu")),
        bt.metrics.Memory(),
        bt.metrics.Custom("double", lambda loss: loss * 2, requires=("loss",)),
        bt.metrics.Extra("margin", on_device=True),
        bt.metrics.Extra("note", on_device=False),
    ]


def _block(layout: Layout, n: int, seed: int, *, timings_absent: bool) -> BlockData:
    rng = np.random.default_rng(seed)
    pick = lambda *shape: rng.choice(VALUES, size=shape)  # noqa: E731
    device, host = pick(n, layout.device_width), pick(n, layout.host_width)
    # mostly plausible rows, so that most values pass and the awkward ones stand out
    plain = rng.random(n) < 0.6
    device[plain] = np.abs(np.nan_to_num(device[plain], nan=1.0, posinf=2.0, neginf=3.0)) % 4
    host[plain] = np.abs(np.nan_to_num(host[plain], nan=1.0, posinf=2.0, neginf=3.0)) % 4
    # Accuracy's columns come from integer counts and class indices: never NaN or infinite
    for span in layout.spans:
        if isinstance(span.metric, bt.metrics.Accuracy):
            d = slice(span.device_offset, span.device_offset + span.metric.device_width)
            device[:, d] = np.nan_to_num(device[:, d], nan=2.0, posinf=9.0, neginf=-5.0)
            h = slice(span.host_offset, span.host_offset + span.metric.host_width)
            host[:, h] = np.nan_to_num(host[:, h], nan=5.0, posinf=5.0, neginf=5.0)
    times = lambda: rng.choice([math.nan, 0.0, 0.01, 0.5, 0.25, 2.0, math.inf, -1.0], size=n)  # noqa: E731
    return BlockData(
        device_values=device,
        host_values=host,
        step=np.arange(100, 100 + n),
        epoch=np.zeros(n, dtype=np.int64),
        batch=np.arange(n),
        wall_time=np.linspace(1.0, 2.0, n),
        samples=np.where(rng.random(n) < 0.1, math.nan, 8.0),
        data_time=np.full(n, math.nan) if timings_absent else times(),
        step_time=times(),
        tokens=np.where(rng.random(n) < 0.5, math.nan, 64.0),
    )


def _weights(decoded: object) -> list[dict[str, float]]:
    """Per record, the MEAN weights that are not the samples (a NaN weight and no weight both mean
    the samples to the reducer)."""
    if isinstance(decoded, DecodedBlock):
        if decoded.weights is None:
            return [{} for _ in range(len(decoded))]
        return [
            {name: w for name, w in zip(decoded.names, row) if not math.isnan(w)} for row in decoded.weights.tolist()
        ]
    return [{k: w for k, w in d.items() if not math.isnan(w)} for d in decoded.weights]  # type: ignore[attr-defined]


def _seen(decoded: object) -> tuple[object, ...]:
    d = decoded
    return (
        [(r.step, r.epoch, r.batch, r.rank, r.wall_time, str(r.values)) for r in d.records],  # type: ignore[attr-defined]
        [(e.step, e.kind, e.message, e.metric, str(e.raw_value)) for e in d.events],  # type: ignore[attr-defined]
        d.input_errors,  # type: ignore[attr-defined]
        [str(w) for w in _weights(d)],
    )


@pytest.mark.parametrize("seed", range(12))
def test_the_block_decoder_decodes_what_the_row_decoder_decoded(seed: int) -> None:
    layout = Layout(_metrics())
    block, row = Decoder(layout.columns, run_id="r", rank=0), RowDecoder(layout.columns, run_id="r", rank=0)
    for part in range(3):  # warnings are reported once per run: later blocks too
        data = _block(layout, 40, seed * 10 + part, timings_absent=part == 1)
        assert _seen(block.decode(data)) == _seen(row.decode(data))
    assert block.anomaly_counts == row.anomaly_counts


def test_real_rows_of_the_default_metrics_decode_the_same() -> None:
    metrics = [
        bt.metrics.Loss(),
        bt.metrics.Accuracy(check_targets_every=1),
        bt.metrics.StepTime(),
        bt.metrics.Throughput(),
    ]
    layout = Layout(metrics)
    g = torch.Generator().manual_seed(0)
    rows, hosts = [], []
    for i in range(20):
        targets = torch.randint(0, 5, (12,), generator=g)
        targets[: i % 13] = -100  # more padding each step, all of it at step 12
        if i == 7:
            targets[-1] = 5  # out of range
        inputs = StepInputs(torch.tensor(0.25 * i), torch.randn(12, 5, generator=g), targets, 12.0)
        rows.append([float(v) for m in metrics for v in m.compute(inputs)])
        hosts.append([v for m in metrics for v in m.read_host(inputs)])
    n = len(rows)
    data = BlockData(
        device_values=np.array(rows),
        host_values=np.array(hosts),
        step=np.arange(n),
        epoch=np.zeros(n, dtype=np.int64),
        batch=np.arange(n),
        wall_time=np.arange(n, dtype=np.float64),
        samples=np.full(n, 12.0),
        data_time=np.full(n, math.nan),
        step_time=np.full(n, 0.01),
        tokens=np.full(n, math.nan),
    )
    block = Decoder(layout.columns, run_id="r", rank=0).decode(data)
    assert _seen(block) == _seen(RowDecoder(layout.columns, run_id="r", rank=0).decode(data))
    assert len(block.input_errors) == 1 and "step 7" in block.input_errors[0]
    assert "accuracy" not in block.records[12].values
    assert block.records[3].values["loss"] == 0.75
