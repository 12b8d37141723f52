"""Storage throughput: metric values per second through each sink, as the dispatcher writes them.

Usage::

    .venv/bin/python bench/storage.py                 # every sink available here
    .venv/bin/python bench/storage.py --runs 7 --pg-dsn postgresql://postgres@127.0.0.1:5432/test

What is measured: ``sink.write(block)`` for blocks shaped like the pipeline's (default 50 records of
10 metrics each, i.e. one flush of 50 steps), into a fresh store per run, timed from the first block
to the last one committed (``close()`` included, so nothing is left buffered). Values are random
floats with a NaN now and then; wall times and steps advance as in training. The block list is
built before the clock starts: only the sink's own work (row building, SQL, I/O) is timed.

The figure is the median of ``--runs`` runs (>= 5); min and max show the spread. Rows:

* ``sqlite`` / ``postgres`` / ``csv`` / ``tensorboard``: the bare sink.
* ``... + resilient``: the same through :class:`batchtap.sinks.resilient.ResilientSink` on its
  healthy path (what the dispatcher runs).
* ``... replay``: the same blocks written a second time into the same store (the upsert path of a
  spool replay).

Then the training-thread side of the goal (per-step cost with every sink attached equal to the cost
without): :func:`bench_training_thread_cost`.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from batchtap.records import Record, RunInfo
from batchtap.sinks.base import Sink

SinkFactory = Callable[[Path], Sink]


def make_blocks(
    n_blocks: int, records_per_block: int, n_metrics: int, seed: int = 0
) -> tuple[RunInfo, list[list[Record]]]:
    """Blocks as the pipeline hands them to sinks: consecutive steps, every metric per record."""
    rng = random.Random(seed)
    run = RunInfo(id=uuid.uuid4().hex, name="bench", config={}, started_at=time.time())
    names = [f"metric_{i}" for i in range(n_metrics)]
    blocks = []
    step = 0
    t = run.started_at
    for _ in range(n_blocks):
        block = []
        for _ in range(records_per_block):
            values = {n: rng.gauss(0.0, 1.0) for n in names}
            if rng.random() < 0.01:
                values[names[0]] = math.nan  # validation failures are stored as NaN
            block.append(Record(run.id, step=step, epoch=0, batch=step, rank=0, wall_time=t, values=values))
            step += 1
            t += 0.01
        blocks.append(block)
    return run, blocks


def time_sink(make: Callable[[], Sink], run: RunInfo, blocks: list[list[Record]], *, replay: bool = False) -> float:
    """Seconds to write every block (and close). With ``replay``, write them once untimed first."""
    sink = make()
    sink.start_run(run)
    if replay:
        for block in blocks:
            sink.write(block)
    t0 = time.perf_counter()
    for block in blocks:
        sink.write(block)
    sink.flush()
    sink.close()
    return time.perf_counter() - t0


def bench_training_thread_cost(
    pg_dsn: str, reps: int = 5, steps: int = 300, batches: tuple[int, ...] = (32, 64)
) -> None:
    """Per-step cost on the training thread: no sinks vs every sink attached, with the pipeline in a
    thread and in its own process, all four interleaved in one run.

    A small CNN step (digits-sized, a few ms on a CPU) so the sinks' work competes with real work.
    For each batch size and repetition every variant runs (order rotated) for ``steps`` timed steps
    after a warm-up; reported: the median over repetitions of each variant's median step time, the
    median host time of ``tap.step()`` itself, and per pipeline the median of the per-repetition
    ratios all sinks / no sinks.
    """
    import torch
    import torch.nn.functional as F

    import batchtap as bt
    from batchtap.demo.digits import DigitsCNN

    tmp = Path(tempfile.mkdtemp(prefix="bt-bench-steps-"))
    torch.manual_seed(0)
    model = DigitsCNN(width=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    schema = "bt_bench_steps_" + uuid.uuid4().hex[:8]
    made = 0

    def all_sinks() -> list[Sink]:
        nonlocal made
        made += 1
        sinks: list[Sink] = [
            bt.sinks.SQLite(tmp / f"s{made}.db"),
            bt.sinks.CSV(tmp / f"c{made}" / "m.csv"),
            bt.sinks.JSONL(tmp / f"j{made}.jsonl"),
        ]
        try:
            sinks.append(bt.sinks.TensorBoard(tmp / f"tb{made}"))
        except ImportError:
            pass
        if pg_dsn:
            try:
                sinks.append(bt.sinks.Postgres(pg_dsn, schema=schema))
            except Exception:  # noqa: BLE001 - report without PostgreSQL
                pass
        return sinks

    def one(sinks: list[Sink], pipeline: str, data: list) -> tuple[float, float]:
        step_times, call_times = [], []
        with bt.Tap(sinks=sinks, flush_every=50, pipeline=pipeline) as tap, tap.run(name="bench"):  # type: ignore[arg-type]
            for i in range(steps + 20):
                x, y = data[i % len(data)]
                t0 = time.perf_counter()
                out = model(x)
                loss = F.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                t1 = time.perf_counter()
                tap.step(loss=loss, outputs=out, targets=y)
                t2 = time.perf_counter()
                if i >= 20:
                    step_times.append(t2 - t0)
                    call_times.append(t2 - t1)
        return statistics.median(step_times), statistics.median(call_times)

    variants = [(p, s) for p in ("thread", "process") for s in ("no sinks", "all sinks")]
    for batch in batches:
        data = [(torch.randn(batch, 1, 8, 8), torch.randint(0, 10, (batch,))) for _ in range(16)]
        results: dict[tuple[str, str], list[tuple[float, float]]] = {v: [] for v in variants}
        for rep in range(reps):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for pipeline, sinks in order:
                results[(pipeline, sinks)].append(one([] if sinks == "no sinks" else all_sinks(), pipeline, data))
        print(
            f"\ntraining-thread cost, {reps} interleaved reps x {steps} steps (DigitsCNN width 32, batch {batch}, "
            f"{torch.get_num_threads()} torch threads):"
        )
        print(f"{'pipeline':<10}{'sinks':<12}{'ms/step':>10}{'tap.step() us':>16}")
        for (pipeline, sinks), rows in results.items():
            print(
                f"{pipeline:<10}{sinks:<12}{statistics.median(r[0] for r in rows) * 1e3:>10.3f}"
                f"{statistics.median(r[1] for r in rows) * 1e6:>16.1f}"
            )
        for pipeline in ("thread", "process"):
            ratios = [b[0] / a[0] for a, b in zip(results[(pipeline, "no sinks")], results[(pipeline, "all sinks")])]
            print(
                f"{pipeline}: all sinks / no sinks (median of per-rep ratios): {statistics.median(ratios):.3f} "
                f"[{', '.join(f'{r:.3f}' for r in ratios)}]"
            )
        ratios = [b[0] / a[0] for a, b in zip(results[("thread", "no sinks")], results[("process", "all sinks")])]
        print(
            f"process + all sinks / thread + no sinks: {statistics.median(ratios):.3f} "
            f"[{', '.join(f'{r:.3f}' for r in ratios)}]"
        )
    if pg_dsn:
        try:
            import psycopg

            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        except Exception:  # noqa: BLE001
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs per row (median reported; >= 5)")
    p.add_argument("--blocks", type=int, default=200, help="blocks per run")
    p.add_argument("--records", type=int, default=50, help="records (steps) per block")
    p.add_argument("--metrics", type=int, default=10, help="metrics per record")
    p.add_argument("--pg-dsn", default="postgresql://postgres@127.0.0.1:5432/test", help="PostgreSQL DSN ('' to skip)")
    p.add_argument("--only", default="", help="comma-separated row-name prefixes to run (default: all)")
    p.add_argument("--step-reps", type=int, default=5, help="training-thread cost: interleaved repetitions")
    p.add_argument("--step-count", type=int, default=300, help="training-thread cost: timed steps per run")
    p.add_argument(
        "--torch-threads", type=int, default=0, help="training-thread cost: torch.set_num_threads (0: torch's default)"
    )
    args = p.parse_args(argv)
    if args.runs < 5:
        p.error(f"--runs must be >= 5 for a meaningful median, got {args.runs}")

    from batchtap.sinks.csv import CSV
    from batchtap.sinks.resilient import ResilientSink
    from batchtap.sinks.sqlite import SQLite

    tmp = Path(tempfile.mkdtemp(prefix="bt-bench-"))
    counter = iter(range(10**9))

    def fresh(name: str) -> Path:
        return tmp / f"{name}-{next(counter)}"

    rows: list[tuple[str, Callable[[], Sink], bool]] = [
        ("sqlite", lambda: SQLite(fresh("db")), False),
        ("sqlite + resilient", lambda: ResilientSink(SQLite(fresh("db")), spool_path=fresh("spool")), False),
        ("csv", lambda: CSV(fresh("csv") / "m.csv"), False),
    ]
    shared_db = fresh("replay-db")
    rows.append(("sqlite replay", lambda: SQLite(shared_db), True))
    try:
        from batchtap.sinks.tensorboard import TensorBoard

        rows.append(("tensorboard", lambda: TensorBoard(fresh("tb")), False))
    except ImportError:
        print("tensorboard: skipped (pip install 'batchtap[tensorboard]')", file=sys.stderr)

    schemas: list[str] = []
    if args.pg_dsn:
        try:
            import psycopg

            from batchtap.sinks.postgres import Postgres

            psycopg.connect(args.pg_dsn, connect_timeout=3).close()

            def pg() -> Sink:
                schemas.append("bt_bench_" + uuid.uuid4().hex[:10])
                return Postgres(args.pg_dsn, schema=schemas[-1])

            replay_schema = "bt_bench_" + uuid.uuid4().hex[:10]
            schemas.append(replay_schema)
            rows += [
                ("postgres", pg, False),
                ("postgres + resilient", lambda: ResilientSink(pg(), spool_path=fresh("spool")), False),
                ("postgres replay", lambda: Postgres(args.pg_dsn, schema=replay_schema), True),
            ]
        except Exception as exc:  # noqa: BLE001 - a benchmark reports and goes on
            print(f"postgres: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)

    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        rows = [r for r in rows if any(r[0].startswith(w) for w in wanted)]

    run, blocks = make_blocks(args.blocks, args.records, args.metrics)
    n_values = args.blocks * args.records * args.metrics
    print(
        f"{n_values:,} values per run: {args.blocks} blocks x {args.records} records x {args.metrics} metrics; "
        f"median of {args.runs} runs"
    )
    print(f"{'sink':<24}{'values/s (median)':>20}{'min':>12}{'max':>12}{'ms/block':>10}")
    try:
        for name, make, replay in rows:
            rates = [n_values / time_sink(make, run, blocks, replay=replay) for _ in range(args.runs)]
            med = statistics.median(rates)
            per_block_ms = 1000 * args.records * args.metrics / med
            print(f"{name:<24}{med:>20,.0f}{min(rates):>12,.0f}{max(rates):>12,.0f}{per_block_ms:>10.2f}")
    finally:
        if schemas:
            import psycopg

            with psycopg.connect(args.pg_dsn, autocommit=True) as conn:
                for s in schemas:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')
    if not args.only or "steps" in args.only:
        if args.torch_threads:
            import torch

            torch.set_num_threads(args.torch_threads)
        bench_training_thread_cost(args.pg_dsn, reps=args.step_reps, steps=args.step_count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
