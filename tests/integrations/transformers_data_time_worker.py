"""One rank of ``test_transformers_data_time.py``'s dispatched loader on 2 gloo ranks:
``torchrun --nproc-per-node 2 transformers_data_time_worker.py SLOW_RAW_BATCHES OUT_DIR``.

``BatchtapTrainer`` on a stream (an ``IterableDataset``: Accelerate dispatches it, the main process
fetching 2 raw batches of 4 per step, one per process, and broadcasting them); the raw batches listed in
``SLOW_RAW_BATCHES`` (comma-separated) are slow to fetch. Every rank's own rows go to
``OUT_DIR/store.db`` (``per_rank_rows``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

if __name__ == "__main__":  # run as a file by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import batchtap as bt
from batchtap.integrations.transformers import BatchtapTrainer
from tests.integrations.test_transformers import _args, _bert, _Data

BATCH = 4
#: seconds a slow raw batch waits (a sleep per sample)
SLOW = 0.3


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self, batches: int, slow: set[int]) -> None:
        self.data, self.slow = _Data(batches * BATCH, lm=False), slow

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self.data)):
            if i // BATCH in self.slow:
                time.sleep(SLOW / BATCH)
            yield self.data[i]


def main(slow: set[int], out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    tap = bt.Tap(sinks=[bt.sinks.SQLite(str(out / "store.db"))], flush_every=2, per_rank_rows=True)
    args = _args(out / f"trainer{rank}", gradient_accumulation_steps=1, max_steps=4, per_device_train_batch_size=BATCH)
    trainer = BatchtapTrainer(model=_bert(), args=args, train_dataset=_Stream(8, slow), tap=tap)
    kind = type(trainer.get_train_dataloader()).__name__
    assert kind == "DataLoaderDispatcher", kind
    trainer.train()
    tap.close()


if __name__ == "__main__":
    main({int(b) for b in sys.argv[1].split(",") if b}, Path(sys.argv[2]))
