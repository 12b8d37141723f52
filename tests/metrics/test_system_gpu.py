"""bt.metrics.System on a real GPU through NVIDIA's own NVML bindings (runs in bench/gpu_check.sh;
skipped without CUDA). On by default there; its values are stored per step while 300 CUDA steps run
with the sync debugger armed, and utilisation is high while the GPU is kept busy."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import batchtap as bt
from batchtap.metrics.system import System, nvml_available
from tests.conftest import ListSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_on_by_default_and_stored_per_step_without_a_sync() -> None:
    pytest.importorskip("pynvml", reason="carry nvidia-ml-py to the GPU machine (bench/gpu_check.sh)")
    assert nvml_available()
    assert any(isinstance(m, System) for m in bt.metrics.default_metrics())
    device = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4096, 2048, device=device), torch.randint(0, 10, (4096,), device=device)
    sink = ListSink()
    with bt.Tap(optimizer=opt, sinks=[sink], flush_every=20) as tap, tap.run("gpu-system"):
        for step in range(300):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step == 1:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            tap.step(loss=loss, outputs=out, targets=y)
        torch.cuda.set_sync_debug_mode(0)
    steps = [r for r in sink.records if not r.sparse]
    assert len(steps) == 300
    index = torch.cuda.current_device()  # NVML's order may differ; every device is sampled
    names = [n for n in steps[-1].values if n.startswith("gpu")]
    assert any(n.endswith("_util") for n in names) and any(n.endswith("_power") for n in names), names
    late = steps[100:]
    busiest = max(sum(r.values.get(n, 0.0) for r in late) / len(late) for n in names if n.endswith("_util"))
    assert busiest > 50, (index, busiest)  # the GPU was kept busy: NVML says so
    assert all(0 <= r.values[n] <= 100 for r in late for n in names if "_util" in n and n in r.values)
    if importlib.util.find_spec("psutil") is not None:  # the image may lack psutil: GPU values stand alone
        assert all(r.values["process_rss"] > 0 for r in late)
    assert not [e for e in sink.events if "GPU metrics left out" in e.message]
