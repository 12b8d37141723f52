"""Real process groups: 2 and 3 gloo processes on loopback, launched as torchrun would."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    scenario: str, world: int, out: Path, timeout: float = 120, pipeline: str = "thread"
) -> tuple[list[dict], list[dict], float]:
    port = _free_port()
    procs = []
    started = time.monotonic()
    for rank in range(world):
        # the ranks import batchtap from this checkout's src/, whatever is installed (a mutation run
        # tests a scratch copy of the tree this way)
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
            BATCHTAP_TEST_PIPELINE=pipeline,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.pipeline.dist_worker", scenario, str(out)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    elapsed = time.monotonic() - started
    results = []
    for rank, log in enumerate(logs):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"log": log, "code": procs[rank].returncode})
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return results, lines, elapsed


def _records(lines: list[dict]) -> list[dict]:
    return [r for r in lines if r["type"] == "record"]


def assert_union_reference(records: list[dict], results: list[dict]) -> None:
    """Each reduced record's loss and accuracy equal those of the union of every rank's batch."""
    for record in records:
        rows = [res["local"][record["step"]] for res in results]
        total = sum(row["n"] for row in rows)
        assert record["loss"] == pytest.approx(sum(row["loss"] * row["n"] for row in rows) / total, rel=1e-6)
        assert record["accuracy"] == pytest.approx(sum(row["correct"] for row in rows) / total, abs=1e-12)


@pytest.mark.parametrize(
    ("world", "pipeline"), [(2, "thread"), (3, "thread"), (2, "process")], ids=["2-ranks", "3-ranks", "2-ranks-process"]
)
def test_reduced_loss_and_accuracy_equal_the_union_reference(tmp_path: Path, world: int, pipeline: str) -> None:
    # pipeline="process": each rank's pipeline process reduces with the others' in a gloo group of their own
    results, lines, _ = _launch("reduce", world, tmp_path, pipeline=pipeline)
    records = _records(lines)
    assert [r["step"] for r in records] == list(range(40))
    assert {r["rank"] for r in records} == {-1}  # reduced rows only, written once
    assert sum(1 for r in lines if r["type"] == "run_start") == 1
    assert_union_reference(records, results)
    for record in records:
        if record["step"] == 0:  # the first step has no measured start on any rank
            assert "slowest_rank" not in record and "throughput" not in record
        else:
            assert record["slowest_rank"] in range(world)


def test_accuracy_with_uneven_padding_is_total_correct_over_total_kept_targets(tmp_path: Path) -> None:
    # Ranks keep different numbers of targets (-100 padding): weighting by samples would be wrong.
    results, lines, _ = _launch("padded", 2, tmp_path)
    records = _records(lines)
    assert [r["step"] for r in records] == list(range(40))
    for record in records:
        rows = [res["local"][record["step"]] for res in results]
        assert record["accuracy"] == pytest.approx(
            sum(row["correct"] for row in rows) / sum(row["kept"] for row in rows), abs=1e-12
        )


def test_per_rank_rows_write_one_row_per_rank_and_step(tmp_path: Path) -> None:
    _, lines, _ = _launch("per_rank", 2, tmp_path)
    keys = [(r["step"], r["rank"]) for r in _records(lines)]
    assert sorted(keys) == sorted((s, k) for s in range(40) for k in (-1, 0, 1))
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("pipeline", ["thread", "process"])
def test_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path, pipeline: str) -> None:
    results, lines, _ = _launch("nan", 2, tmp_path, pipeline=pipeline)
    stops = {res["stopped_at"] for res in results}
    # NaN at step 7 on rank 1: sent with the flush of step 9, agreed (asynchronously) at the flush of step 14
    assert stops == {14}
    assert all("rank 1" in res["reason"] or "non-finite" in res["reason"] for res in results)
    end = [r for r in lines if r["type"] == "run_end"][0]
    assert end["status"] == "stopped"
    assert any(e["kind"] == "action" and e["rank"] == 1 for e in lines if e["type"] == "event")
    assert math.isnan(float(_records(lines)[7]["loss"]))


@pytest.mark.parametrize("pipeline", ["thread", "process"])
def test_a_rule_decision_acts_on_every_rank_at_the_same_step(tmp_path: Path, pipeline: str) -> None:
    results, lines, _ = _launch("rule", 3, tmp_path, pipeline=pipeline)
    stops = {res["stopped_at"] for res in results}
    # The rule fires on step 11's record once the block of steps 10-14 was exchanged; the worker
    # waits for that after each flush (tap.flush()), so the schedule is fixed: every rank has the
    # decision before step 19's flush, sends it in that flush's agreement, and acts on the completed
    # agreement at the next flush step, 24 -- every rank at the same step.
    assert stops == {24}
    assert all("threshold(loss>0.0) at step 11" in res["reason"] for res in results)
    assert [r for r in lines if r["type"] == "run_end"][0]["status"] == "stopped"


def test_a_killed_rank_makes_the_others_fail_within_the_timeout(tmp_path: Path) -> None:
    results, lines, elapsed = _launch("kill", 3, tmp_path)
    assert results[2].get("code") == 3
    for res in results[:2]:
        assert "ranks could not agree" in res["error"] and "a rank probably died" in res["error"]
    assert elapsed < 60
    steps = [r["step"] for r in _records(lines)]
    assert steps[:10] == list(range(10))  # everything reduced before the death is stored
    end = [r for r in lines if r["type"] == "run_end"][0]
    assert end["status"] == "failed" and "DistributedError" in end["stop_reason"]


def test_straggler_fields_name_the_slow_rank(tmp_path: Path) -> None:
    # A controllable step clock in each rank: rank 1's steps take 0.25 s, rank 0's 0.125 s, exactly.
    _, lines, _ = _launch("straggler", 2, tmp_path)
    records = _records(lines)
    assert [r["step"] for r in records] == list(range(40))
    assert "slowest_rank" not in records[0]  # step 0 has no start mark
    assert [r["slowest_rank"] for r in records[1:]] == [1.0] * 39
    assert [r["step_time_spread"] for r in records[1:]] == [2.0] * 39
    assert [r["step_time"] for r in records[1:]] == [0.25] * 39


def test_every_reduction_kind_over_real_ranks(tmp_path: Path) -> None:
    # Three ranks with exact, different step times (0.125, 0.25, 0.5 s), uneven batches, different
    # grad norms and learning rates; per-rank rows come with the global rows, so each global value
    # is checked against the ranks' own: throughput summed, step time, grad norm and lr as maxima,
    # loss weighted by samples, and the straggler named with its spread.
    results, lines, _ = _launch("kinds", 3, tmp_path)
    rows: dict[tuple[int, int], dict] = {(r["step"], r["rank"]): r for r in _records(lines)}
    assert sorted(rows) == sorted((s, k) for s in range(40) for k in (-1, 0, 1, 2))
    work = (0.125, 0.25, 0.5)
    for step in range(1, 40):
        g = rows[(step, -1)]
        own = [rows[(step, k)] for k in range(3)]
        local = [res["local"][step] for res in results]
        assert [o["step_time"] for o in own] == list(work)
        assert [o["throughput"] for o in own] == pytest.approx([loc["n"] / t for loc, t in zip(local, work)], rel=1e-12)
        assert g["throughput"] == pytest.approx(sum(loc["n"] / t for loc, t in zip(local, work)), rel=1e-12)
        assert g["step_time"] == 0.5
        assert g["grad_norm"] == max(loc["grad_norm"] for loc in local) == 3.5 + step % 4
        assert g["lr"] == 2.5  # the largest of 0.5, 1.5, 2.5
        total = sum(loc["n"] for loc in local)
        assert g["loss"] == pytest.approx(sum(loc["loss"] * loc["n"] for loc in local) / total, rel=1e-6)
        assert g["accuracy"] == pytest.approx(sum(loc["correct"] for loc in local) / total, abs=1e-12)
        assert g["slowest_rank"] == 2.0 and g["step_time_spread"] == 4.0
    assert "throughput" not in rows[(0, -1)] and "step_time" not in rows[(0, -1)]


def test_no_host_read_in_steps_with_a_process_group(tmp_path: Path) -> None:
    results, _, _ = _launch("noread", 2, tmp_path)
    assert [res["reads"] for res in results] == [0, 0]


def test_data_parallel_works_unchanged() -> None:
    import torch

    import batchtap as bt
    from tests.conftest import ListSink

    sink = ListSink()
    model = torch.nn.DataParallel(torch.nn.Linear(6, 3))
    with bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy(), bt.metrics.GradNorm(model)], [sink]) as tap, tap.run():
        x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        tap.step(loss=loss, outputs=out, targets=y)
    assert sink.records[0].values["accuracy"] == pytest.approx((out.argmax(1) == y).float().mean().item())
