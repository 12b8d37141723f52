"""Layers against a hand computation with ``.item()`` in the same loop: per-layer gradient norms
before the step, weight norms after it, the update ratio, on every N-th optimizer step only; fp32,
AMP with a GradScaler, a closure step, frozen and gradient-less layers; no host read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from batchtap.errors import ConfigError
from batchtap.hostreads import HostReadCounter
from batchtap.metrics import StepInputs, StepTiming
from batchtap.metrics.base import BlockTiming
from batchtap.metrics.layers import layer_groups
from tests.conftest import ListSink
from tests.metrics._helpers import CountOps

REL = 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 16), nn.Tanh()), nn.Linear(16, 4))


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(t.detach().double().pow(2).sum().item() for t in tensors))


def _grads(groups: dict[str, list[nn.Parameter]]) -> dict[str, float]:
    return {k: _norm([p.grad for p in ps if p.grad is not None]) for k, ps in groups.items()}


def _weights(groups: dict[str, list[nn.Parameter]]) -> dict[str, list[torch.Tensor]]:
    return {k: [p.detach().clone() for p in ps] for k, ps in groups.items()}


def _expected(groups, grads, before) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, ps in groups.items():
        out[f"grad_norm/{k}"] = grads[k]
        out[f"weight_norm/{k}"] = _norm(list(ps))
        out[f"update_ratio/{k}"] = _norm([p.detach() - b for p, b in zip(ps, before[k])]) / _norm(before[k])
    return out


def _assert_records(sink: ListSink, expected: dict[int, dict[str, float]], steps: int, names: list[str]) -> None:
    by_step = {r.step: r.values for r in sink.records}
    assert sorted(by_step) == list(range(steps))
    for step in range(steps):
        got = {
            k: v for k, v in by_step[step].items() if k.split("/")[0] in ("grad_norm", "weight_norm", "update_ratio")
        }
        if step not in expected:
            assert got == {}, f"step {step} is not captured, got {got}"
            continue
        assert sorted(got) == sorted(names), step
        for name, value in expected[step].items():
            assert got[name] == pytest.approx(value, rel=REL), (step, name)


@pytest.mark.parametrize("every", [1, 3], ids=["every=1", "every=3"])
def test_fp32_loop_equals_item_on_every_nth_step(sink: ListSink, every: int) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    groups = layer_groups(model)
    layers = bt.metrics.Layers(model, every=every)
    tap = bt.Tap([bt.metrics.Loss(), layers], [sink], flush_every=4)
    g = torch.Generator().manual_seed(1)
    expected: dict[int, dict[str, float]] = {}
    steps = 10
    with tap, tap.run(name="layers"):
        for step in range(steps):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            grads, before = _grads(groups), _weights(groups)
            opt.step()
            if step % every == 0:
                expected[step] = _expected(groups, grads, before)
            tap.step(loss=loss)
    names = [o.name for o in layers.outputs()]
    assert names[:3] == ["grad_norm/0", "grad_norm/2", "grad_norm/3"]
    _assert_records(sink, expected, steps, names)
    assert not [e for e in sink.events if e.kind in (bt.EventKind.ANOMALY, bt.EventKind.WARNING)]


@pytest.mark.parametrize(
    ("unscale", "fused"),
    [(False, False), (True, False), (False, True)],
    ids=["scaler.step-unscales", "unscale_-then-clip", "fused-Adam-unscales-in-its-kernel"],
)
def test_amp_grad_scaler_values_are_unscaled(sink: ListSink, unscale: bool, fused: bool) -> None:
    model = _model()
    if fused:  # the scaler hands its scale to the fused kernel: the gradients reach the step still scaled
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    groups = layer_groups(model)
    layers = bt.metrics.Layers(model, every=2, scaler=scaler)
    tap = bt.Tap([bt.metrics.Loss(), layers], [sink], flush_every=4)
    g = torch.Generator().manual_seed(2)
    expected: dict[int, dict[str, float]] = {}
    steps = 8
    with tap, tap.run(name="amp"):
        for step in range(steps):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
                grads = _grads(groups)
            else:
                scale = scaler.get_scale()
                grads = {k: v / scale for k, v in _grads(groups).items()}
            before = _weights(groups)
            scaler.step(opt)
            if step % 2 == 0:
                expected[step] = _expected(groups, grads, before)
            tap.step(loss=loss)
            scaler.update()
    _assert_records(sink, expected, steps, [o.name for o in layers.outputs()])


def test_closure_step_takes_the_closures_gradients(sink: ListSink) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = layer_groups(model)
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Layers(model, every=1)], [sink], flush_every=2)
    g = torch.Generator().manual_seed(3)
    expected: dict[int, dict[str, float]] = {}
    with tap, tap.run(name="closure"):
        for step in range(4):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
            before = _weights(groups)
            seen: dict[str, dict[str, float]] = {}

            def closure() -> torch.Tensor:
                opt.zero_grad()
                out = F.cross_entropy(model(x), y)  # noqa: B023 - called at once by step()
                out.backward()
                seen["grads"] = _grads(groups)
                return out

            loss = opt.step(closure)
            expected[step] = _expected(groups, seen["grads"], before)
            tap.step(loss=loss)
    _assert_records(sink, expected, 4, list(expected[0]))


def test_frozen_and_unused_layers(sink: ListSink) -> None:
    torch.manual_seed(4)
    model = nn.ModuleDict({"emb": nn.Linear(4, 8), "frozen": nn.Linear(8, 8), "unused": nn.Linear(8, 2)})
    model["frozen"].requires_grad_(False)
    layers = bt.metrics.Layers(model, every=1)
    assert layers.names == ("emb", "unused")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tap = bt.Tap([bt.metrics.Loss(), layers], [sink], flush_every=2)
    with tap, tap.run(name="unused"):
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = model["frozen"](model["emb"](torch.randn(3, 4))).pow(2).mean()
            loss.backward()
            opt.step()
            tap.step(loss=loss)
    for record in sink.records:
        assert "grad_norm/emb" in record.values and "grad_norm/unused" not in record.values
        assert record.values["update_ratio/unused"] == 0.0  # weights present, never moved
    assert not [e for e in sink.events if e.kind is bt.EventKind.ANOMALY]


def test_tap_step_before_optimizer_step_shows_at_the_next_captured_row(sink: ListSink) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = layer_groups(model)
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Layers(model, every=2)], [sink], flush_every=2)
    g = torch.Generator().manual_seed(5)
    expected: dict[int, dict[str, float]] = {}
    with tap, tap.run(name="before"):
        for step in range(6):
            x, y = torch.randn(8, 10, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            tap.step(loss=loss)
            grads, before = _grads(groups), _weights(groups)
            opt.step()
            if (step + 1) % 2 == 0 and step + 1 < 6:
                expected[step + 1] = _expected(groups, grads, before)  # the step after row `step`
    _assert_records(sink, expected, 6, list(expected[2]))


def test_no_host_read_and_no_device_op_on_steps_that_do_not_capture() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layers = bt.metrics.Layers(model, every=4)
    inputs = [StepInputs(None, None, None, 8.0) for _ in range(8)]
    columns = torch.zeros(8, layers.device_width)
    write = layers.row_writer(inputs[0], columns)
    ops_per_step = []
    for step in range(8):
        model(torch.randn(8, 10)).pow(2).mean().backward()
        with CountOps() as counted:
            opt.step()
            layers.read_host(inputs[step])
            write(inputs[step], step, False)
        assert counted.host_reads == []
        ops_per_step.append(len(counted.ops) - _optimizer_ops(opt))
    assert [n > 0 for n in ops_per_step] == [True, False, False, False, True, False, False, False]


@pytest.mark.parametrize("metric", ["Layers", "Histograms"])
def test_steps_that_do_not_capture_never_call_the_metric_in_the_optimizer_step(metric: str) -> None:
    # the listener is off between captures: the optimizer step runs none of the metric's code
    import cProfile
    import pstats

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watched = getattr(bt.metrics, metric)(model, every=3)
    inputs = [StepInputs(None, None, None, 8.0) for _ in range(7)]
    # the metric's own code (its listener's step_begins/step_ends live there); optimizer_hooks.py's
    # shared step watch runs for any other listener alive in the process (another run's lr)
    files = ("metrics/layers.py", "metrics/histograms.py", "metrics/layer_sharding.py")
    called = []
    for step in range(7):
        model(torch.randn(8, 10)).pow(2).mean().backward()
        profile = cProfile.Profile()
        profile.enable()
        opt.step()
        profile.disable()
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        called.append(any(f[0].replace("\\", "/").endswith(files) for f in stats))
        watched.read_host(inputs[step])
    assert called == [True, False, False, True, False, False, True]


def _optimizer_ops(opt: torch.optim.Optimizer) -> int:
    """Ops of one bare SGD step of the same parameters (measured on a copy)."""
    params = [p.detach().clone().requires_grad_() for group in opt.param_groups for p in group["params"]]
    for p, q in zip(params, [p for group in opt.param_groups for p in group["params"]]):
        p.grad = q.grad.clone()
    copy = torch.optim.SGD(params, lr=0.1)
    with CountOps() as counted:
        copy.step()
    return len(counted.ops)


def test_row_writer_compute_and_block_agree() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a, b = bt.metrics.Layers(model, every=1), bt.metrics.Layers(model, every=1)
    model(torch.randn(8, 10)).pow(2).mean().backward()
    opt.step()
    inputs = StepInputs(None, None, None, 8.0)
    computed = [float(v) for v in a.compute(inputs)] + list(a.read_host(inputs))
    columns = torch.full((2, b.device_width), -1.0)
    host = list(b.read_host(inputs))
    b.row_writer(inputs, columns)(inputs, 1, True)
    assert columns[1].tolist() + host == pytest.approx(computed)
    timing = StepTiming(8.0, 0.1, math.nan)
    rows = np.array([computed, [0.0] * b.device_width + list(b._not_captured)])
    values, present = a.finalize_block(rows, BlockTiming(*(np.full(2, 1.0) for _ in range(4))))
    assert values[0].tolist() == pytest.approx(list(a.finalize(computed, timing)))
    assert present.tolist() == [[True] * a.device_width, [False] * a.device_width]
    assert list(a.finalize(list(rows[1]), timing)) == [None] * a.device_width


def test_depth_groups_and_bad_arguments() -> None:
    model = _model()
    assert list(layer_groups(model, depth=2)) == ["0", "2.0", "3"]
    with pytest.raises(ConfigError, match="every must be an int >= 1, got 0"):
        bt.metrics.Layers(model, every=0)
    with pytest.raises(ConfigError, match="depth must be an int >= 1, got 0"):
        bt.metrics.Layers(model, depth=0)
    with pytest.raises(ConfigError, match="needs the model"):
        bt.metrics.Layers(list(model.parameters()))  # type: ignore[arg-type]


@pytest.mark.parametrize("every", [1, 3], ids=["every=1", "every=3"])
def test_no_host_read_in_tap_steps(sink: ListSink, every: int) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Layers(model, every=every)], [sink], flush_every=5)
    reads = HostReadCounter()
    with tap, tap.run(name="reads"):
        for step in range(30):
            opt.zero_grad()
            loss = F.cross_entropy(model(torch.randn(8, 10)), torch.randint(0, 4, (8,)))
            loss.backward()
            if step == 0:  # the run's first step allocates the ring's host views: once per run
                opt.step()
                tap.step(loss=loss)
                continue
            with reads:  # the optimizer step too: the pre-hook's capture runs there
                opt.step()
                tap.step(loss=loss)
    assert reads.count == 0, reads.reads
    captured = [r.step for r in sink.records if "grad_norm/0" in r.values]
    assert captured == list(range(0, 30, every))


def test_decoders_are_torch_free_twins() -> None:
    import subprocess
    import sys

    from batchtap.metrics.layer_decoders import HistogramsDecoding, LayersDecoding, MFUDecoding

    model = _model()
    for metric, kind in (
        (bt.metrics.Layers(model), LayersDecoding),
        (bt.metrics.Histograms(model), HistogramsDecoding),
        (bt.metrics.MFU(), MFUDecoding),
    ):
        twin = metric.decoder()
        assert type(twin) is kind, type(twin)
    code = "import sys, batchtap.metrics.layer_decoders\nassert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
