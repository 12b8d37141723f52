"""System decodes without torch: under ``pipeline="process"`` its decoder samples and decodes in the
pipeline process, whose ``sys.modules`` never holds torch."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import batchtap as bt
from batchtap.metrics.sampling import SystemDecoding
from batchtap.metrics.system import System
from tests.pipeline.probe_sinks import ModulesSink, notes


def test_systems_decoder_is_its_torch_free_twin() -> None:
    system = System(gpu=False, background=False)
    decoder = system.decoder()
    assert type(decoder) is SystemDecoding and decoder.sampler is system.sampler


def test_a_process_pipeline_run_with_system_never_loads_torch_in_the_pipeline_process(tmp_path: Path) -> None:
    path = tmp_path / "modules.jsonl"
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = [*bt.metrics.default_metrics(), System(interval=0.005)]
    sink = bt.sinks.SQLite(tmp_path / "bt.db")
    tap = bt.Tap(metrics, sinks=[ModulesSink(path), sink], optimizer=optimizer, flush_every=4, pipeline="process")
    with tap.run(name="system-torch-free"):
        for _ in range(12):
            x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            tap.step(loss=loss, outputs=out, targets=y)
    tap.close()
    seen = notes(path)
    assert {n["call"] for n in seen} >= {"start_run", "write", "end_run"}
    assert all(n["pid"] != os.getpid() for n in seen), "the sink ran in the training process"
    assert not any(n["torch"] for n in seen), f"the pipeline process loaded torch: {seen}"
    # and System's values were decoded there: the training process's memory, sampled in the pipeline
    # process (the steps before its sampler's first sample have none)
    with bt.store.open(tmp_path / "bt.db") as st:
        rss = [p.value for p in st.series("system-torch-free", "process_rss")]
    assert rss and all(v > 2**20 for v in rss)
