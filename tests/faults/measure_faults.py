"""Figures for docs/storage.md "What happens on each fault": run by hand, not by pytest.

    .venv/bin/python -m tests.faults.measure_faults [--trials N] [--default-timeouts]

Needs the PostgreSQL test server (BATCHTAP_TEST_PG_DSN). Prints one line per trial and a summary.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path

import psycopg
import torch

import batchtap as bt
from tests.faults._proxy import BlackHoleProxy
from tests.store._helpers import PG_DSN

STEPS, HOLE_AT = 2000, 500


def _via(port: int) -> str:
    url = urllib.parse.urlsplit(PG_DSN)
    netloc = f"{url.username + '@' if url.username else ''}127.0.0.1:{port}"
    return urllib.parse.urlunsplit((url.scheme, netloc, url.path, url.query, ""))


def _count(schema: str, run_id: str) -> int:
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        return int(
            conn.execute("SELECT COUNT(*) FROM metrics WHERE run_id = %s AND metric = 'loss'", (run_id,)).fetchone()[0]
        )


def trial(spool: bool, default_timeouts: bool) -> dict[str, float]:
    schema = "bt_measure_" + uuid.uuid4().hex[:10]
    url = urllib.parse.urlsplit(PG_DSN)
    proxy = BlackHoleProxy(url.hostname or "127.0.0.1", url.port or 5432)
    pg_kw = {} if default_timeouts else {"timeout_s": 2.0, "connect_timeout_s": 2.0}
    tap_kw = {} if default_timeouts else {"end_timeout": 20.0}
    tmp = Path(tempfile.mkdtemp())
    tap = bt.Tap(
        sinks=[bt.sinks.Postgres(_via(proxy.port), schema=schema, **pg_kw)],
        queue_size=2,
        flush_every=10,
        spool_dir=tmp / "spool" if spool else None,
        **tap_kw,
    )
    out: dict[str, float] = {}
    t_hole = 0.0
    with tap, tap.run(name="measure") as info:
        for i in range(STEPS):
            if i == HOLE_AT:
                proxy.black_hole()
                t_hole = time.monotonic()
            tap.step(loss=torch.tensor(float(i)))
        out["loop_end_s"] = time.monotonic() - t_hole
    out["run_return_s"] = time.monotonic() - t_hole
    out["stored_during"] = _count(schema, info.id)
    if spool:
        with bt.Tap(sinks=[bt.sinks.Postgres(PG_DSN, schema=schema)], spool_dir=tmp / "spool"):
            pass
        out["stored_after_replay"] = _count(schema, info.id)
    proxy.close()
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--default-timeouts", action="store_true")
    args = parser.parse_args()
    for spool in (True, False):
        rows = [trial(spool, args.default_timeouts) for _ in range(args.trials)]
        for r in rows:
            print(f"spool={spool} " + " ".join(f"{k}={v:.1f}" for k, v in r.items()), flush=True)
        print(
            f"spool={spool} max run_return_s={max(r['run_return_s'] for r in rows):.1f} "
            f"median={statistics.median(r['run_return_s'] for r in rows):.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
