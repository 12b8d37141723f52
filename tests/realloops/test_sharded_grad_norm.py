"""Two real gloo ranks on loopback, each holding a disjoint shard of the parameters (ZeRO-2 style,
see ``sharded_worker.py``): ``GradNorm(local_params, sharded=True)`` on every rank, and rank 0's
stored (reduced, ``rank == ALL_RANKS``) record holds the global L2 norm over all shards, equal to
the norm computed by hand from the all-gathered shard gradients."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import batchtap as bt
from tests.realloops._launch import launch
from tests.realloops._loops import F32_REL

WORLD = 2


def _launch(out: Path, timeout: float = 120) -> list[dict]:
    launch("tests.realloops.sharded_worker", out, WORLD, timeout=timeout)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_sharded_grad_norm_is_the_global_norm_over_disjoint_shards(tmp_path: Path) -> None:
    results = _launch(tmp_path)
    rank0, rank1 = results
    steps = len(rank0["refs"])
    assert rank0["local_tensors"] == rank1["local_tensors"] == 4  # 8 parameter tensors, split in two

    # rank 0 stores one reduced record per step, 0..N-1; rank 1 stores nothing
    records = [r for r in rank0["records"] if not r["sparse"]]
    assert [r["step"] for r in records] == list(range(steps))
    assert {r["rank"] for r in records} == {bt.ALL_RANKS}
    assert rank1["records"] == [] and rank1["events"] == []
    assert not [e for e in rank0["events"] if e["kind"] in ("anomaly", "action", "warning")], rank0["events"]

    for record, ref in zip(records, rank0["refs"]):
        step = record["step"]
        assert ref["grads_held"] == 4  # only the rank's own shard had gradients when tap.step ran
        assert all(size > 0 for size in ref["shard_sizes"])
        global_norm = ref["gathered_norm"]
        # three references agree: all-gathered shards, the full averaged gradient, root of summed squares
        assert global_norm == pytest.approx(ref["full_norm"], rel=1e-12)
        assert global_norm == pytest.approx(math.sqrt(sum(n * n for n in ref["rank_norms"])), rel=1e-6)
        # neither shard alone is the global norm (so a max over ranks would be wrong)
        assert max(ref["rank_norms"]) < global_norm * (1 - 1e-3)
        # float32 norms per rank, combined as sqrt(sum of squares): float32 rounding
        assert record["values"]["grad_norm"] == pytest.approx(global_norm, rel=F32_REL), step
        assert record["values"]["loss"] == pytest.approx(ref["loss"], rel=F32_REL), step
        assert record["values"]["accuracy"] == pytest.approx(ref["accuracy"], rel=1e-9), step
