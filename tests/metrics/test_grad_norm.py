"""GradNorm against clip_grad_norm_'s return value: low-precision gradients, gradients that are
gone, a norm the loop passes, AMP scaling, sharded parameters."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import batchtap as bt
from batchtap.metrics import StepInputs
from tests.metrics._helpers import CountOps, raw, step

NO_INPUTS = StepInputs(None, None, None, 4.0)


def _model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)).to(dtype)
    model(torch.randn(5, 6, dtype=dtype)).pow(2).sum().backward()
    return model


def _reference(params) -> float:
    """clip_grad_norm_'s return value over float32 copies of the gradients."""
    copies = []
    for p in params:
        if p.grad is not None:
            c = torch.nn.Parameter(p.detach().float())
            c.grad = p.grad.float()
            copies.append(c)
    return torch.nn.utils.clip_grad_norm_(copies, max_norm=math.inf).item()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=["fp32", "fp64", "bf16", "fp16"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_norm_equals_clip_grad_norm_in_fp32(dtype, seed) -> None:
    model = _model(seed, dtype)
    got = step(bt.metrics.GradNorm(model), NO_INPUTS)[0]
    assert got == pytest.approx(_reference(model.parameters()), rel=1e-6)


def test_mixed_dtypes_and_missing_grads() -> None:
    model = _model(2)
    model[2].to(torch.bfloat16)
    model[2].weight.grad = torch.randn(3, 9, dtype=torch.bfloat16)
    model[0].bias.grad = None  # a frozen / unused parameter
    got = step(bt.metrics.GradNorm(model), NO_INPUTS)[0]
    assert got == pytest.approx(_reference(model.parameters()), rel=1e-6)


def test_many_bf16_parameters_take_three_device_ops() -> None:
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(17, dtype=torch.bfloat16)) for _ in range(100)]
    for p in params:
        p.grad = torch.randn(17, dtype=torch.bfloat16)
    metric = bt.metrics.GradNorm(params)
    with torch.no_grad(), CountOps() as counted:
        metric.compute(NO_INPUTS)
    assert len(counted.ops) <= 3, counted.ops  # _foreach_norm, stack, vector_norm
    assert step(metric, NO_INPUTS)[0] == pytest.approx(_reference(params), rel=1e-6)


def test_no_gradient_is_absent_with_a_warning() -> None:
    model = _model(4)
    model.zero_grad(set_to_none=True)
    metric = bt.metrics.GradNorm(model)
    columns = raw(metric, NO_INPUTS)
    assert metric.finalize(columns, None) == (None,)  # type: ignore[arg-type]
    assert metric.warning(columns) == (
        "grad_norm: no optimizer step of the model's parameters ran since the previous row and no parameter "
        "had a gradient when tap.step() ran (zero_grad(set_to_none=True) before tap.step, or tap.step twice per "
        "optimizer step?); the value is left out at such steps. Call tap.step once per optimizer step, or pass "
        "tap.step(grad_norm=clip_grad_norm_(...))"
    )
    # with gradients: a value and no warning
    model(torch.randn(2, 6)).sum().backward()
    columns = raw(metric, NO_INPUTS)
    assert metric.warning(columns) is None
    assert metric.finalize(columns, None)[0] == pytest.approx(_reference(model.parameters()), rel=1e-6)  # type: ignore[arg-type,index]


def test_zero_grad_without_set_to_none_is_a_true_zero() -> None:
    model = _model(5)
    model.zero_grad(set_to_none=False)
    assert step(bt.metrics.GradNorm(model), NO_INPUTS) == [0.0]


@pytest.mark.parametrize("model_given", [False, True], ids=["no-model", "model"])
@pytest.mark.parametrize("kind", ["tensor", "float", "inf-float"])
def test_passed_norm_is_used_instead_of_computing(model_given, kind) -> None:
    model = _model(6)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)  # returns the pre-clip norm
    value = {"tensor": norm, "float": norm.item(), "inf-float": math.inf}[kind]
    metric = bt.metrics.GradNorm(model if model_given else None)
    got = step(metric, StepInputs(None, None, None, 4.0, grad_norm=value))[0]
    expected = math.inf if kind == "inf-float" else norm.item()
    assert got == pytest.approx(expected, rel=1e-7)
    assert got != pytest.approx(_reference(model.parameters()))  # not the clipped gradients' norm


def test_without_model_or_passed_norm_the_value_is_absent_silently() -> None:
    metric = bt.metrics.GradNorm()
    columns = raw(metric, NO_INPUTS)
    assert metric.finalize(columns, None) == (None,)  # type: ignore[arg-type]
    assert metric.warning(columns) is None


def test_only_the_default_name_takes_the_passed_norm() -> None:
    model = _model(7)
    named = bt.metrics.GradNorm(model, name="grad_norm_g")
    assert [o.name for o in named.outputs()] == ["grad_norm_g"]
    assert not named.takes_step_grad_norm and bt.metrics.GradNorm(model).takes_step_grad_norm
    got = step(named, StepInputs(None, None, None, 4.0, grad_norm=123.0))[0]
    assert got == pytest.approx(_reference(model.parameters()), rel=1e-6)


def _amp_model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loss = model(torch.randn(6, 8)).pow(2).mean()
    scaler.scale(loss).backward()
    return model, opt, scaler


def test_scaled_gradients_before_unscale_are_divided_by_the_scale() -> None:
    model, opt, scaler = _amp_model(8)
    metric = bt.metrics.GradNorm(model, scaler=scaler)
    before = step(metric, NO_INPUTS)[0]
    scaled = _reference(model.parameters())
    scaler.unscale_(opt)
    unscaled = _reference(model.parameters())
    assert scaled == pytest.approx(unscaled * 2**10, rel=1e-6)  # the gradients did carry the scale
    assert before == pytest.approx(unscaled, rel=1e-6)


def test_after_unscale_and_after_step_no_division() -> None:
    model, opt, scaler = _amp_model(9)
    metric = bt.metrics.GradNorm(model, scaler=scaler)
    scaler.unscale_(opt)
    unscaled = _reference(model.parameters())
    assert step(metric, NO_INPUTS)[0] == pytest.approx(unscaled, rel=1e-6)
    scaler.step(opt)  # stage STEPPED, before update()
    assert step(metric, NO_INPUTS)[0] == pytest.approx(unscaled, rel=1e-6)


def test_step_without_unscale_then_no_division() -> None:
    model, opt, scaler = _amp_model(10)
    metric = bt.metrics.GradNorm(model, scaler=scaler)
    scaler.step(opt)  # unscales the gradients itself
    assert step(metric, NO_INPUTS)[0] == pytest.approx(_reference(model.parameters()), rel=1e-6)


def test_disabled_scaler_changes_nothing() -> None:
    model = _model(11)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert step(bt.metrics.GradNorm(model, scaler=scaler), NO_INPUTS)[0] == pytest.approx(
        _reference(model.parameters()), rel=1e-6
    )


def test_scaler_division_is_one_op_and_never_reads_the_scale() -> None:
    model, _, scaler = _amp_model(12)
    metric = bt.metrics.GradNorm(model, scaler=scaler)
    with torch.no_grad(), CountOps() as counted:
        metric.compute(NO_INPUTS)
    assert counted.host_reads == [] and len(counted.ops) <= 4, counted.ops


def test_gradient_based_and_reduction_declarations() -> None:
    model = _model(13)
    assert bt.metrics.GradNorm.gradient_based
    assert bt.metrics.GradNorm(model).outputs()[0].reduce is bt.metrics.Reduce.MAX
    assert bt.metrics.GradNorm(model, sharded=True).outputs()[0].reduce is bt.metrics.Reduce.L2
    assert not bt.metrics.GradNorm(model).per_micro_batch


def test_bad_configuration() -> None:
    with pytest.raises(bt.ConfigError, match="GradNorm got no parameters"):
        bt.metrics.GradNorm([])
    with pytest.raises(bt.ConfigError, match="GradNorm needs a torch.amp.GradScaler, got float"):
        bt.metrics.GradNorm(_model(14), scaler=2.0)  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dtensor_parameters_give_the_global_norm_declared_global() -> None:
    # The two-rank FSDP2 run (tests/realloops/test_fsdp2.py) checks the value over real shards.
    # In a subprocess: a process group here would change how every later test's Tap behaves.
    script = textwrap.dedent(
        f"""
        import os, torch, torch.distributed as dist
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "{_free_port()}"
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        import batchtap as bt
        from batchtap.metrics import StepInputs
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (1,))
        w = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
        w.grad = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
        plain = torch.nn.Parameter(torch.randn(3))
        plain.grad = torch.randn(3)
        metric = bt.metrics.GradNorm([w, plain])
        # summed over the mesh on the device: already global, never combined across ranks again
        assert not metric.sharded and metric.outputs()[0].reduce is bt.metrics.Reduce.GLOBAL
        (got,) = metric.compute(StepInputs(None, None, None, 1.0))
        assert type(got) is torch.Tensor, type(got)  # a plain tensor: it goes into the ring
        expected = torch.cat([w.grad.full_tensor().flatten(), plain.grad]).norm()
        assert abs(got.item() - expected.item()) < 1e-5, (got, expected)
        assert not bt.metrics.GradNorm([w], sharded=True).sharded  # DTensors know their mesh
        # the DTensor clip_grad_norm_ returns is taken as the global norm it holds, not refused
        total = torch.nn.utils.clip_grad_norm_([w], 1e9)  # torch itself refuses DTensors mixed with tensors
        assert type(total) is not torch.Tensor
        (passed,) = metric.compute(StepInputs(None, None, None, 1.0, grad_norm=total))
        assert type(passed) is torch.Tensor and abs(passed.item() - w.grad.full_tensor().norm().item()) < 1e-5
        dist.destroy_process_group()
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_tap_step_twice_per_optimizer_step_leaves_the_second_row_out(sink) -> None:
    """``tap.step`` after the optimizer step, then again after ``zero_grad(set_to_none=True)`` (a
    second call per step, e.g. for an evaluation batch): the first row has the step's norm, the
    second has none left to measure — left out with a warning, never the first row's norm again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = []
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.GradNorm(model)], [sink], flush_every=4)
    with tap, tap.run(name="twice"):
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 5)), torch.randint(0, 3, (8,)))
            loss.backward()
            refs.append(math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters())))
            opt.step()
            tap.step(loss=loss)
            opt.zero_grad(set_to_none=True)
            tap.step(loss=loss.detach())
    rows = [r for r in sink.records if not r.sparse]
    assert len(rows) == 6
    for i, ref in enumerate(refs):
        assert rows[2 * i].values["grad_norm"] == pytest.approx(ref, rel=1e-5)
        assert "grad_norm" not in rows[2 * i + 1].values
    warnings = [e.message for e in sink.events if e.kind == bt.EventKind.WARNING]
    assert len([m for m in warnings if "tap.step twice per optimizer step" in m]) == 1, warnings
