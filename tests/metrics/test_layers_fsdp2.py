"""Layers and Histograms under FSDP2 (``fully_shard``) on two real gloo ranks, through the explicit
API and ``bt.autolog(layers=N)``: every per-layer value equals the ``.item()`` computation over the
whole parameters (``.full_tensor()``) in the same run, on every N-th step only, with no host read
added (``layers_fsdp2_worker.py``). A rank's own shard would give a smaller norm and histograms
counting half the elements: both are outside the tolerances used here."""

from __future__ import annotations

import json

import pytest

from tests.metrics.layers_fsdp2_worker import BINS, EVERY, STEPS
from tests.realloops._launch import launch

pytest.importorskip("torch.distributed.fsdp")

WORLD = 2
REL = 1e-5
KINDS = ("grad_norm", "weight_norm", "update_ratio")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("layers_fsdp2")
    launch("tests.metrics.layers_fsdp2_worker", out, WORLD, timeout=300)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def _histogram(values: dict[str, float], prefix: str) -> list[float]:
    return [values[f"{prefix}/min"], values[f"{prefix}/max"], *(values[f"{prefix}/{i}"] for i in range(BINS))]


@pytest.mark.parametrize("front_end", ["tap", "autolog"])
def test_fsdp2_per_layer_values_equal_the_full_tensor_truth(ranks: list[dict], front_end: str) -> None:
    refs = ranks[0][front_end]["refs"]
    assert refs == ranks[1][front_end]["refs"]  # the references are of the whole parameters: equal on both ranks
    rows = [r for r in ranks[0][front_end]["records"] if not r["sparse"]]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert ranks[1][front_end]["records"] == []  # rank 0 stores the reduced rows
    bad = [e for r in ranks for e in r[front_end]["events"] if e["kind"] in ("anomaly", "action")]
    bad += [e for r in ranks for e in r[front_end]["events"] if e["kind"] == "warning" and "error" in e["message"]]
    assert not bad, bad
    layers = ("0", "2", "4")
    for row, ref in zip(rows, refs):
        got = {k: v for k, v in row["values"].items() if k.split("/")[0] in KINDS and "/" in k}
        if row["step"] % EVERY:
            assert got == {}, row["step"]
            assert not any(k.startswith("hist/") for k in row["values"])
            continue
        assert sorted(got) == sorted(
            f"{kind}/{k}" for kind in ("grad_norm", "weight_norm", "update_ratio") for k in layers
        )
        for name, value in got.items():
            assert value == pytest.approx(ref[name], rel=REL), (row["step"], name)
        if front_end != "tap":
            continue
        for kind in ("weight", "grad"):
            for k in layers:
                stored = _histogram(row["values"], f"hist/{kind}/{k}")
                expected = ref[f"hist/{kind}/{k}"]
                assert stored[:2] == pytest.approx(expected[:2], rel=REL), (row["step"], kind, k)
                assert stored[2:] == expected[2:], (row["step"], kind, k)  # global counts: both ranks' shards


def test_fsdp2_layers_add_no_host_read(ranks: list[dict]) -> None:
    bare = [ref["host_reads"] for ref in ranks[0]["bare"]["refs"]][2:]
    for front_end in ("tap", "autolog"):
        # after the first steps, which build the ring: the same count as the loop without batchtap
        assert [ref["host_reads"] for ref in ranks[0][front_end]["refs"]][2:] == bare, front_end


def test_histograms_refuse_a_model_sharded_in_part(ranks: list[dict]) -> None:
    # summing bin counts over the mesh would count the unsharded parameters once per rank
    message = ranks[0]["sharded_in_part"]
    assert "Histograms on sharded (DTensor) parameters needs every watched parameter sharded the same way" in message
    assert (
        "mixes 1 sharding(s) with 2 unsharded parameter(s)" in message and "fix: fully_shard the whole model" in message
    )
