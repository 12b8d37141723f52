"""One rank of ``test_accelerate_data_time.py``'s dispatched loader on 2 gloo ranks:
``torchrun --nproc-per-node 2 accelerate_data_time_worker.py SLOW_RAW_BATCHES OUT_DIR``.

Accelerate makes the gloo group on the CPU from torchrun's environment. The loader is dispatched
(``dispatch_batches=True``): the main process fetches 2 raw batches per step (one per process) and
broadcasts them; the raw batches listed in ``SLOW_RAW_BATCHES`` (comma-separated) are slow to fetch.
Writes ``OUT_DIR/waits{R}.json`` from rank 0 (whose sinks get every rank's rows): (batch, data_time) of
each step as rank ``R`` measured it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from tests.integrations.test_accelerate_data_time import _rows


def main(slow: set[int], out: Path) -> None:
    torch.set_num_threads(1)
    rows = _rows(slow, batches=8, dispatch=True)
    if os.environ["RANK"] == "0":  # its sinks get every rank's rows
        for rank in range(2):
            waits = [(batch, waited) for r, batch, waited in rows if r == rank]
            (out / f"waits{rank}.json").write_text(json.dumps(waits))


if __name__ == "__main__":
    main({int(b) for b in sys.argv[1].split(",") if b}, Path(sys.argv[2]))
