"""One training job writing a shared PostgreSQL store: ``python -m tests.pipeline.pg_job_worker
DSN SCHEMA NAME MY_FLAG OTHER_FLAG``. Trains 60 steps; after 30 it flushes (stored, committed),
touches MY_FLAG and waits for OTHER_FLAG — the other job's first half stored — before going on, so
two jobs that blocked each other's writes would both wait here until the test's timeout."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import batchtap as bt


def main(dsn: str, schema: str, name: str, mine: Path, other: Path) -> None:
    sink = bt.sinks.Postgres(dsn, schema=schema)
    with bt.Tap([bt.metrics.Loss()], [sink], flush_every=10) as tap, tap.run(name=name):
        for step in range(60):
            tap.step(loss=torch.tensor(float(step)))
            if step == 29:
                tap.flush()
                mine.touch()
                deadline = time.monotonic() + 60
                while not other.exists():
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{name}: the other job never stored its first half")
                    time.sleep(0.01)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))
