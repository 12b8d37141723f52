"""One rank of the RankAgreement test: ``python -m tests.pipeline.agreement_worker OUT_DIR``.

Launched by ``test_agreement.py`` as real gloo processes (MASTER_ADDR/PORT, RANK, WORLD_SIZE in the
environment). Rank r receives r + 1 rule verdicts per flush; rank 1 asks to stop at flush 1.
Writes ``OUT_DIR/rank{R}.json``: per flush, the verdicts agreed and the agreed stop.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from batchtap.pipeline.chain.control import Control, Verdict
from batchtap.pipeline.ranks.agreement import ProcessGroups, RankAgreement

FLUSHES = 5


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    agreement = RankAgreement(ProcessGroups.create(30.0), 30.0)
    control = Control()
    log = []
    for flush in range(FLUSHES):
        if rank == 1 and flush == 1:
            control.request_stop("rank one's reason", flush)
        while control.received < flush * (rank + 1):
            control.post(Verdict([], flush))
        agreed = agreement.exchange(control, flush)
        taken = list(control.take_verdicts(agreed))
        log.append({"agreed": agreed, "taken": len(taken), "stop": control.stop_reason})
    agreement.close()
    (out / f"rank{rank}.json").write_text(json.dumps(log))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
