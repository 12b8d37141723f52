"""A training process for the durability tests: ``python -m tests.durability_worker DB [RESUME_ID]``.

Trains a tiny model forever (until signalled), storing into SQLite with small flushes, and prints
``step N`` after each step so the parent knows how far it got.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import batchtap as bt


def main(db: str, resume: str | None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.Accuracy()], [bt.sinks.SQLite(db)], flush_every=5)
    with tap, tap.run(name="durable", resume=resume) as run:
        print(f"run {run.id}", flush=True)
        for step in range(10**9):
            x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tap.step(loss=loss, outputs=out, targets=y)
            print(f"step {step}", flush=True)
            if resume and step >= 40:
                break


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
