"""FSDP2 (``fully_shard``) and tensor parallel (``parallelize_module``) on two real gloo ranks, through ``bt.autolog()`` and the explicit API:
every stored value equals the ``.item()`` truth of the same run (``fsdp2_worker.py``).

Loss and accuracy are the mean of the ranks' values (equal batches), the lr the one the step used,
and the gradient norm the global pre-clip norm over both ranks' shards — whether it came back from
``clip_grad_norm_`` as a ``DTensor``, was passed as ``.full_tensor()``, or was computed by batchtap
from the sharded gradients. A global norm combined across ranks again would be sqrt(2) x too large.
"""

from __future__ import annotations

import json
import math

import pytest

import batchtap as bt
from tests.realloops._launch import launch
from tests.realloops._loops import F32_REL

pytest.importorskip("torch.distributed.fsdp")

WORLD = 2
FRONT_ENDS = ("autolog-clip", "autolog", "tap-dtensor", "tap-full", "tap-computed", "autolog-tp")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp2")
    launch("tests.realloops.fsdp2_worker", out, WORLD, timeout=300)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_fsdp2_values_equal_the_item_truth(ranks: list[dict], front_end: str) -> None:
    rank0, rank1 = ranks[0][front_end], ranks[1][front_end]
    refs = rank0["refs"]
    assert len(refs) == 20
    rows = [r for r in rank0["records"] if not r["sparse"]]
    assert [r["step"] for r in rows] == list(range(20)), [r["step"] for r in rows]  # 20 of 20 steps
    assert {r["rank"] for r in rows} == {bt.ALL_RANKS}
    assert rank1["records"] == []  # rank 0 stores the reduced rows
    bad = [e for e in rank0["events"] + rank1["events"] if e["kind"] in ("anomaly", "warning", "action")]
    if front_end.startswith("autolog"):  # autolog says once what it took the loop for: no error of its own
        bad = [e for e in bad if e["kind"] != "warning" or "error" in e["message"]]
    assert not bad, bad
    for row, ref in zip(rows, refs):
        values = row["values"]
        assert values["loss"] == pytest.approx(ref["loss"], rel=F32_REL), row["step"]
        assert values["accuracy"] == pytest.approx(ref["accuracy"], rel=F32_REL), row["step"]
        assert values["lr"] == pytest.approx(ref["lr"], rel=1e-12), row["step"]
        assert values["grad_norm"] == pytest.approx(ref["grad_norm"], rel=F32_REL), row["step"]
        if ref["clipped_norm"] is not None:  # the loop clipped: never the clipped norm stored
            assert ref["clipped_norm"] < ref["grad_norm"] / 2
    lrs = [r["values"]["lr"] for r in rows]
    assert len(set(lrs)) > 10  # the cosine schedule moved it: each step's own lr is checked
    # no host read added per step: the same count as the loop without batchtap (after the first
    # steps, which build the ring and the short path)
    bare = [ref["host_reads"] for ref in ranks[0]["bare-tp" if front_end.endswith("-tp") else "bare"]["refs"]][3:]
    assert [ref["host_reads"] for ref in refs][3:] == bare, (front_end, bare)


def test_a_global_norm_combined_again_would_be_caught(ranks: list[dict]) -> None:
    # what the old reduction stored (sqrt(world) x the norm) is outside the tolerance used above
    ref = ranks[0]["tap-full"]["refs"][0]["grad_norm"]
    assert math.sqrt(WORLD) * ref != pytest.approx(ref, rel=F32_REL)
