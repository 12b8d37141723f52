"""One rank of a distributed test: ``python -m tests.pipeline.dist_worker SCENARIO OUT_DIR``.

Launched by ``test_distributed.py`` as real processes (MASTER_ADDR/PORT, RANK, WORLD_SIZE in the
environment, gloo on loopback), the way torchrun launches them. Writes ``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import batchtap as bt
from batchtap.hostreads import HostReadCounter


class ManualClock:
    """The step clock's ``time.perf_counter``, moved only by this worker: step times are exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


#: seconds of "work" per step on each rank in the clocked scenarios (binary-exact; the last rank is slowest)
WORK = (0.125, 0.25, 0.5)


def main(scenario: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)
    result: dict = {"rank": rank, "world": world}
    per_rank = scenario in ("per_rank", "kinds")
    timeout = 5.0 if scenario == "kill" else 60.0
    sinks = [bt.sinks.JSONL(out / "metrics.jsonl")]
    metrics = [bt.metrics.Loss(), bt.metrics.Accuracy(), bt.metrics.StepTime(), bt.metrics.Throughput()]
    clock = None
    if scenario in ("straggler", "kinds"):
        import types

        import batchtap.capture.clock as clock_module

        clock = ManualClock()
        clock_module.time = types.SimpleNamespace(perf_counter=clock.perf_counter)  # type: ignore[assignment]
    optimizer = None
    if scenario == "kinds":
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.5 + rank)
        metrics += [bt.metrics.GradNorm(), bt.metrics.LearningRate(optimizer)]
    rules = [bt.Threshold("loss", above=0.0, patience=12, action="stop")] if scenario == "rule" else []
    pipeline = os.environ.get("BATCHTAP_TEST_PIPELINE", "thread")  # test_distributed runs some scenarios with both
    tap = bt.Tap(
        metrics,
        sinks,
        flush_every=5,
        per_rank_rows=per_rank,
        collective_timeout=timeout,
        rules=rules,
        pipeline=pipeline,
    )  # type: ignore[arg-type]
    local = []
    try:
        with tap, tap.run(name=scenario):
            for step in range(40):
                n = 6 + 5 * rank + step % 3  # uneven per-rank batch sizes
                outputs = torch.randn(n, 4)
                targets = torch.randint(0, 4, (n,))
                if scenario == "padded":
                    targets[: 1 + 3 * rank + step % 2] = -100  # uneven padding: ranks keep different counts
                loss = F.cross_entropy(outputs, targets, ignore_index=-100)
                if scenario == "nan" and rank == 1 and step == 7:
                    loss = loss * math.nan
                if clock is not None:
                    clock.now += WORK[rank]  # this step's work, as the step clock sees it
                if scenario == "kill" and rank == world - 1 and step == 12:
                    os._exit(3)  # dies without a word, like an OOM-killed worker
                if scenario == "noread" and step > 0:
                    with HostReadCounter() as reads:
                        tap.step(loss=loss, outputs=outputs, targets=targets)
                        tap.should_stop
                    result["reads"] = result.get("reads", 0) + reads.count
                elif scenario == "kinds":
                    grad_norm = torch.tensor(1.5 + rank + step % 4)
                    tap.step(loss=loss, outputs=outputs, targets=targets, grad_norm=grad_norm)
                else:
                    tap.step(loss=loss, outputs=outputs, targets=targets)
                if scenario == "rule" and (step + 1) % 5 == 0:
                    # Wait (every rank alike) until the pipeline thread reduced the block just
                    # flushed and ran the rule on it: when the decision arrives is then fixed.
                    tap.flush()
                local.append(
                    {
                        "step": step,
                        "n": n,
                        "loss": loss.item(),
                        "correct": (outputs.argmax(1) == targets).sum().item(),
                        "kept": (targets != -100).sum().item(),
                        **({"grad_norm": 1.5 + rank + step % 4} if scenario == "kinds" else {}),
                    }
                )
                if tap.should_stop:
                    result["stopped_at"] = step
                    result["reason"] = tap.stop_reason
                    break
    except bt.DistributedError as exc:
        result["error"] = str(exc)
        result["error_at"] = time.time()
    result["local"] = local
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if "error" not in result:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
