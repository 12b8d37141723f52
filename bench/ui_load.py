"""How fast `batchtap ui` opens a 1,000,000-step run, how many bytes that takes, and how soon a
live run's new steps reach an open page.

1. Writes a SQLite store (with the SQLite sink's schema and its upsert, not by training 10^6 steps):
   one finished run of ``--steps`` steps with the seven metrics of a default CPU run (loss,
   accuracy, grad_norm, lr, step_time, data_time, throughput), a one-step loss spike and a few
   anomaly events.
2. ``--repeat`` times: starts ``batchtap ui --db STORE --port 0`` as its own process and opens the
   run's page twice in headless Chromium (Debian's ``chromium``, driven by Playwright): *cold* (the
   fresh server reads every line from the store) and *warm* (the server has the decimated lines in
   memory). The load time is from navigation to every chart drawn (``body[data-ready]``, the
   page's own clock); also when the page sent its first series request, and the bytes of the
   response bodies the page received (BokehJS apart: the browser caches it), and the CPU time the
   server process used for the load (independent of how busy the machine is). The load average
   is printed at the start and the end (the machine's cores are shared).
3. Zoomed in: the time of one series request for a 1,000-step window (raw points).
4. Live: a second run written by the SQLite sink at 10 flushes a second (10 steps each) while its
   page is open for ``--live-seconds``: the delay from each flush's commit to the page having that
   step, and the page's long tasks (over 50 ms) meanwhile.

Run: ``.venv/bin/python bench/ui_load.py`` (``--quick``: 20,000 steps, 1 repeat, 3 s live).

``.venv/bin/python bench/ui_load.py server-load [...]``: memory and descriptors of the server under
50 live streams + 500 requests (no browser; see ``server-load --help``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks.sqlite import SQLite
from batchtap.store.connect import connect_sqlite
from batchtap.store.schema import SQLITE, UPSERT_METRICS, transaction

METRICS = ("loss", "accuracy", "grad_norm", "lr", "step_time", "data_time", "throughput")
CHROMIUM = "/usr/bin/chromium"


def write_big_run(path: Path, steps: int, *, run_id: str = "b" * 32, spike_at: int | None = None) -> str:
    """A finished run of ``steps`` steps, written with the SQLite sink's schema and upsert."""
    sink = SQLite(path)
    started = 1.7e9
    info = RunInfo(run_id, "big", {"lr": 0.1, "batch_size": 64}, started_at=started, metrics=METRICS)
    sink.start_run(info)
    spike_at = steps // 2 + 123 if spike_at is None else spike_at
    events = [
        Event(run_id, step, EventKind.ANOMALY, f"loss=nan at step {step}", started + step * 0.01, "loss", float("nan"))
        for step in (steps // 5, steps // 3)
    ]
    sink.write([], events)
    sink.close()
    rng = np.random.default_rng(0)
    conn = connect_sqlite(path, create=True)
    chunk = 200_000
    for lo in range(0, steps, chunk):
        s = np.arange(lo, min(steps, lo + chunk))
        wall = started + s * 0.01
        values = {
            "loss": 2.0 / np.sqrt(1 + s / 1000) + rng.normal(0, 0.02, len(s)),
            "accuracy": np.clip(1 - 1 / np.sqrt(1 + s / 1000) + rng.normal(0, 0.02, len(s)), 0, 1),
            "grad_norm": 1 + rng.random(len(s)),
            "lr": 0.1 * 0.5 ** (s // (steps // 4 + 1)),
            "step_time": 0.008 + rng.random(len(s)) * 0.002,
            "data_time": 0.001 + rng.random(len(s)) * 0.001,
            "throughput": 6000 + rng.random(len(s)) * 500,
        }
        if lo <= spike_at < lo + len(s):
            values["loss"][spike_at - lo] = 50.0  # one step: decimation must keep it
        with transaction(conn, SQLITE):
            for name in METRICS:
                v = values[name]
                conn.executemany(
                    UPSERT_METRICS,
                    zip(
                        [run_id] * len(s),
                        [name] * len(s),
                        s.tolist(),
                        [0] * len(s),
                        [0] * len(s),
                        s.tolist(),
                        wall.tolist(),
                        v.tolist(),
                    ),
                )
    conn.close()
    sink = SQLite(path)
    info.status, info.ended_at = RunStatus.FINISHED, started + steps * 0.01
    sink.end_run(info)
    sink.close()
    return run_id


def start_ui(db: Path) -> tuple[subprocess.Popen[str], str]:
    """``batchtap ui --db DB --port 0`` in its own process; its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchtap.cli.main", "ui", "--db", str(db), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    url = line.split(" at ", 1)[1].strip().rstrip("/")
    return proc, url


def main() -> None:
    if sys.argv[1:2] == ["server-load"]:
        server_load(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--live-seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="20,000 steps, 1 repeat, 3 s live (a smoke run)")
    parser.add_argument("--keep", default=None, help="write the store here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeat, args.live_seconds = 20_000, 1, 3.0
    from playwright.sync_api import sync_playwright

    folder = Path(args.keep or tempfile.mkdtemp(prefix="bt-ui-bench-"))
    db = folder / "ui_bench.db"
    if db.exists() and not args.keep:
        db.unlink()
    t0 = time.perf_counter()
    run_id = write_big_run(db, args.steps) if not db.exists() else "b" * 32
    print(
        f"store: {db} ({db.stat().st_size / 1e6:.0f} MB, {args.steps:,} steps x {len(METRICS)} metrics, "
        f"written in {time.perf_counter() - t0:.1f} s)"
    )
    results: dict[str, object] = {
        "steps": args.steps,
        "metrics": len(METRICS),
        "load_average_at_start": os.getloadavg(),
    }
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        cold: list[dict[str, float]] = []
        warm: list[dict[str, float]] = []
        for _ in range(args.repeat):
            # A fresh server each time: the first load reads every line from the store (cold), the
            # second is served from the lines the server kept in memory (warm). The OS file cache
            # holds the store either way (it was just written or read).
            proc, base = start_ui(db)
            try:
                for loads in (cold, warm):
                    cpu = cpu_seconds(proc.pid)
                    loads.append(load_page(browser, base, run_id))
                    loads[-1]["server_cpu_s"] = cpu_seconds(proc.pid) - cpu
            finally:
                proc.terminate()
                proc.wait(10)
        for name, loads in (("cold", cold), ("warm", warm)):
            results[f"{name}_load_s_median"] = statistics.median(x["load_s"] for x in loads)
            results[f"{name}_load_s_all"] = [round(x["load_s"], 3) for x in loads]
            results[f"{name}_first_series_request_s_median"] = statistics.median(x["first_series_s"] for x in loads)
            results[f"{name}_server_cpu_s_median"] = statistics.median(x["server_cpu_s"] for x in loads)
            results[f"{name}_bytes_without_bokehjs"] = statistics.median(x["data_bytes"] for x in loads)
        results.update(
            bokehjs_bytes=cold[0]["js_bytes"],
            requests=cold[0]["requests"],
            loss_points=cold[0]["loss_points"],
            loss_max_shown=cold[0]["loss_max"],
        )
        proc, base = start_ui(db)
        try:
            # zoomed in: one raw window of 1,000 steps
            times = []
            for i in range(5):
                start = args.steps // 3 + i * 1000
                t = time.perf_counter()
                with urllib.request.urlopen(
                    f"{base}/api/runs/{run_id}/series?metric=loss&start={start}&end={start + 999}&width=700"
                ) as r:
                    body = json.loads(r.read())
                times.append(time.perf_counter() - t)
            results.update(
                zoom_1000_steps_s_median=statistics.median(times), zoom_mode=body["mode"], zoom_points=len(body["step"])
            )
            results.update(live(browser, base, db, args.live_seconds))
        finally:
            proc.terminate()
            proc.wait(10)
        browser.close()
    results["load_average_at_end"] = os.getloadavg()
    print(json.dumps(results, indent=2))


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used: what a load costs the server whatever the
    machine's load (the wall time depends on how many other processes share the cores)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_page(browser, base: str, run_id: str) -> dict[str, float]:
    """Open a run's page once: its load time (navigation to every chart drawn, the page's clock),
    when its first series request left, the bytes it received, and what the loss chart shows."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    seen: list = []
    page.on("requestfinished", lambda r: seen.append(r))
    page.goto(f"{base}/run/{run_id}")
    page.wait_for_selector("body[data-ready='1']", timeout=120_000)
    load_s = page.evaluate("() => bt.readyAt") / 1000
    first_series = page.evaluate(
        "() => Math.min(...performance.getEntriesByType('resource')"
        ".filter((e) => e.name.includes('/series?')).map((e) => e.startTime))"
    )
    sizes = [(r.url, r.sizes()["responseBodySize"]) for r in seen]
    out = {
        "load_s": load_s,
        "first_series_s": first_series / 1000,
        "js_bytes": sum(n for u, n in sizes if "/bokeh/" in u),
        "data_bytes": sum(n for u, n in sizes if "/bokeh/" not in u),
        "requests": len(sizes),
        "loss_points": page.evaluate("() => bt.charts.loss.lines[0].source.data.value.length"),
        "loss_max": page.evaluate(
            "() => Math.max(...bt.charts.loss.lines[0].source.data.value.filter(Number.isFinite))"
        ),
    }
    page.close()
    return out


def live(browser, base: str, db: Path, seconds: float) -> dict[str, object]:
    """A run written at 10 flushes/s while its page is open: flush-to-page delays, long tasks."""
    run_id = uuid.uuid4().hex  # a new run each time (a kept store already has earlier ones)
    sink = SQLite(db)
    sink.start_run(RunInfo(run_id, "live", {}, started_at=time.time(), metrics=METRICS))
    step = 0

    def flush(n: int) -> float:
        nonlocal step
        now = time.time()
        records = [
            Record(
                run_id,
                step=step + i,
                epoch=0,
                batch=step + i,
                rank=0,
                wall_time=now,
                values={m: 1.0 / (1 + step + i) for m in METRICS},
            )
            for i in range(n)
        ]
        sink.write(records)
        step += n
        return time.time()

    flush(10)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{base}/run/{run_id}")
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    committed: dict[int, float] = {}
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            at = flush(10)
            committed[step - 1] = at
            time.sleep(0.1)

    page.evaluate("() => { bt.longTasks.length = 0; }")  # only the tasks while the run writes
    thread = threading.Thread(target=writer)
    thread.start()
    delays = []
    seen_step = -1
    end = time.time() + seconds
    while time.time() < end:
        got = page.evaluate("() => bt.lastUpdate")
        if got and got["lastStep"] is not None and got["lastStep"] > seen_step and got["lastStep"] in committed:
            seen_step = got["lastStep"]
            delays.append(got["at"] / 1000 - committed[seen_step])
        time.sleep(0.02)
    stop.set()
    thread.join()
    long_tasks = page.evaluate("() => bt.longTasks")
    page.close()
    info = RunInfo(
        run_id, "live", {}, started_at=time.time(), metrics=METRICS, status=RunStatus.FINISHED, ended_at=time.time()
    )
    sink.end_run(info)
    sink.close()
    return {
        "live_flushes": len(committed),
        "live_delay_s_median": statistics.median(delays) if delays else None,
        "live_delay_s_max": max(delays) if delays else None,
        "live_samples": len(delays),
        "long_tasks_over_50ms": len(long_tasks),
        "longest_task_ms": max(long_tasks, default=0),
    }


SERVER_LOAD = """Memory and file descriptors of `batchtap ui` under load: 50 live streams + 500 requests.

Builds a store (SQLite by default; ``--runs`` runs of ``--steps`` steps x 6 metrics, one of them still
running so its page streams), starts ``batchtap ui`` as its own process, opens ``--streams`` server-sent
event streams (run pages and the live runs table), then sends ``--requests`` requests (runs table,
decimated series at several widths and zooms, events) in ``--bursts`` bursts from 16 client threads,
idle ``--idle`` seconds between bursts (longer than the server's idle connection timeout, so a
connection kept per worker thread would show up as a leak). The server's RSS and open descriptors
are sampled from /proc every 50 ms.

    .venv/bin/python bench/ui_load.py server-load            # 4 runs x 50k steps x 6 metrics
    .venv/bin/python bench/ui_load.py server-load --steps 1000000 --runs 4   # 24M rows, ~1.5 GB

Prints one table: store size, rows, RSS (with its anonymous and file-backed parts) and fds
before/peak/after, requests/s, error count, and the time of a runs-table poll of the running run
after 100 new steps (``--polls``; this appends to the store's running run).
"""

ROOT = Path(__file__).resolve().parents[1]

LOAD_METRICS = ("loss", "accuracy", "lr", "grad_norm", "step_time", "throughput")


def build_load_store(db: Path, runs: int, steps: int) -> list[str]:
    ids = []
    sink = SQLite(db)
    rng = random.Random(0)
    for r in range(runs):
        rid = f"{r:02d}" + "ab" * 15
        ids.append(rid)
        sink.start_run(
            RunInfo(rid, f"load-{r}", {"lr": 10 ** -(r % 4 + 1)}, started_at=1e9 + r, metrics=LOAD_METRICS),
        )
        for start in range(0, steps, 20_000):
            sink.write(
                [
                    Record(
                        rid,
                        step=s,
                        epoch=s // 1000,
                        batch=s % 1000,
                        rank=0,
                        wall_time=1e9 + s * 0.01,
                        values={m: rng.random() * (1 + i) for i, m in enumerate(LOAD_METRICS)},
                    )
                    for s in range(start, min(start + 20_000, steps))
                ]
            )
        if r:  # run 0 stays running: its pages stream
            sink.end_run(
                RunInfo(rid, f"load-{r}", {}, started_at=1e9 + r, status=RunStatus.FINISHED, ended_at=1e9 + steps)
            )
    sink.close()
    return ids


def running_run_polls(db: Path, base: str, run_id: str, polls: int) -> dict[str, object]:
    """What the runs table's poll of the running run costs: ``polls`` times, 100 new steps appended
    to it by the SQLite sink, then ``GET /api/runs`` timed (the live runs table reads the same
    figures every second). The first poll after the load may still read the run in full; the
    median is of the others. Appends ``polls`` x 100 steps to the store's running run."""
    import batchtap.store

    with batchtap.store.open(db, migrate=False) as st:
        last = st.run(run_id).last_step
    step = 0 if last is None else last + 1
    sink = SQLite(db)
    rng = random.Random(1)
    times = []
    try:
        for _ in range(polls + 1):
            sink.write(
                [
                    Record(
                        run_id,
                        step=s,
                        epoch=s // 1000,
                        batch=s % 1000,
                        rank=0,
                        wall_time=1e9 + s * 0.01,
                        values={m: rng.random() * (1 + i) for i, m in enumerate(LOAD_METRICS)},
                    )
                    for s in range(step, step + 100)
                ]
            )
            step += 100
            t = time.perf_counter()
            with urllib.request.urlopen(f"{base}/api/runs", timeout=300) as r:
                r.read()
            times.append(time.perf_counter() - t)
    finally:
        sink.close()
    return {"first": round(times[0], 3), "median_after": round(statistics.median(times[1:]), 4) if polls else None}


def proc_figures(pid: int) -> tuple[float, int, float, float]:
    """RSS in MB, open descriptors, and the RSS's anonymous part (the heap: Python objects,
    SQLite's page caches) and file-backed part (the store's pages mapped by ``PRAGMA mmap_size``,
    shared with the OS file cache; the libraries' code), in MB, of a process."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            got[key] = int(rest.split()[0]) / 1024
    return (
        got.get("VmRSS", 0.0),
        len(os.listdir(f"/proc/{pid}/fd")),
        got.get("RssAnon", 0.0),
        got.get("RssFile", 0.0) + got.get("RssShmem", 0.0),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_load(argv: list[str]) -> None:
    """See SERVER_LOAD."""
    p = argparse.ArgumentParser(
        prog="ui_load.py server-load", description=SERVER_LOAD, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--steps", type=int, default=50_000)
    p.add_argument("--streams", type=int, default=50)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--idle", type=float, default=12.0, help="seconds between bursts (server idle timeout: 10)")
    p.add_argument("--db", type=Path, default=None, help="reuse this store instead of building one")
    p.add_argument(
        "--polls", type=int, default=5, help="polls of the running run timed after the load (each after 100 new steps)"
    )
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bt-uiload-"))
    db = args.db or tmp / "load.db"
    if args.db is None:
        t0 = time.perf_counter()
        ids = build_load_store(db, args.runs, args.steps)
        print(f"built {db} ({db.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f}s", flush=True)
    else:
        import batchtap.store

        with batchtap.store.open(db) as st:
            ids = [r.id for r in st.runs()]
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen(
        [sys.executable, "-m", "batchtap.cli.main", "ui", "--db", str(db), "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert server.stdout is not None
        for line in server.stdout:  # the server prints its address once it accepts connections
            if "at http" in line:
                break
        before = proc_figures(server.pid)
        peak = list(before)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                figures = proc_figures(server.pid)
                peak[:] = [max(a, b) for a, b in zip(peak, figures)]
                stop.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        streams = []
        for i in range(args.streams):
            # as a run page does: its stream starts after the last step it has already drawn
            page = f"{base}/api/runs/{ids[0][:8]}/live?after={args.steps - 1}&events=0"
            url = f"{base}/api/runs/live" if i % 5 == 0 else page
            streams.append(urllib.request.urlopen(url, timeout=60))
            streams[-1].readline()  # the stream is open on the server
        paths = ["/api/runs", f"/api/runs/{ids[0][:8]}", f"/api/runs/{ids[-1]}/events"]
        for rid in ids:
            for width in (300, 800, 1600):
                paths.append(f"/api/runs/{rid}/series?metric=loss&width={width}")
            paths.append(f"/api/runs/{rid}/series?metric=accuracy&start=1000&end={args.steps // 3}&width=900")
        errors = 0
        done = 0
        t0 = time.perf_counter()
        per_burst = args.requests // args.bursts
        for burst in range(args.bursts):
            if burst:
                time.sleep(args.idle)

            def one(path: str) -> bool:
                try:
                    with urllib.request.urlopen(base + path, timeout=120) as r:
                        r.read()
                        return r.status == 200
                except Exception:  # noqa: BLE001 - counted
                    return False

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                results = list(pool.map(one, [paths[(burst * per_burst + k) % len(paths)] for k in range(per_burst)]))
            done += len(results)
            errors += results.count(False)
        busy = time.perf_counter() - t0 - args.idle * (args.bursts - 1)
        for s in streams:
            s.close()
        polls = running_run_polls(db, base, ids[0], args.polls)
        time.sleep(1.0)
        after = proc_figures(server.pid)
        stop.set()
        rows = sum(1 for _ in ids) * args.steps * len(LOAD_METRICS) if args.db is None else None
        print(
            json.dumps(
                {
                    "store_mb": round(db.stat().st_size / 1e6),
                    "rows": rows,
                    "streams": args.streams,
                    "requests": done,
                    "errors": errors,
                    "req_per_s": round(done / busy, 1),
                    "rss_mb": {"before": round(before[0]), "peak": round(peak[0]), "after": round(after[0])},
                    "rss_anon_mb": {"before": round(before[2]), "peak": round(peak[2]), "after": round(after[2])},
                    "rss_file_mb": {"before": round(before[3]), "peak": round(peak[3]), "after": round(after[3])},
                    "fds": {"before": before[1], "peak": peak[1], "after": after[1]},
                    "running_run_poll_s": polls,
                    "load": os.getloadavg(),
                },
                indent=1,
            )
        )
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
