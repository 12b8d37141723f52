"""One rank of a fault test: ``python -m tests.faults._dist_worker SCENARIO OUT_DIR``.

Scenarios: ``per_rank`` (per_rank_rows=True into one SQLite store), ``kill`` (the last rank dies
at step 12 without a word). Writes ``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import batchtap as bt


def main(scenario: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    result: dict = {"rank": rank}
    sinks = [bt.sinks.SQLite(out / "bt.db")] if rank == 0 else []
    tap = bt.Tap(
        [bt.metrics.Loss()],
        sinks,
        flush_every=5,
        per_rank_rows=scenario == "per_rank",
        collective_timeout=10.0 if scenario == "kill" else 60.0,
    )
    try:
        with tap, tap.run(name=scenario) as info:
            result["run_id"] = info.id
            for step in range(40):
                if scenario == "kill" and rank == world - 1 and step == 12:
                    os._exit(3)
                tap.step(loss=torch.rand(()) + rank)
    except bt.DistributedError as exc:
        result["error"] = str(exc)
        result["error_at"] = time.time()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if "error" not in result:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
