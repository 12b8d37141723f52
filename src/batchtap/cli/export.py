"""``batchtap export RUN --format csv|jsonl|parquet [-o FILE]``: a stored run as CSV, JSON lines or Parquet.

CSV and JSONL files are written by batchtap's own CSV and JSONL sinks, so an export reads back with
:func:`batchtap.sinks.csv.read_records` or :func:`batchtap.sinks.jsonl.read_jsonl` (or any CSV/JSON
reader) exactly like a sink's output, and a JSONL export replays into another store with
:func:`batchtap.sinks.jsonl.replay`.
Parquet (pyarrow, ``pip install 'batchtap[pandas]'``) is written by :mod:`batchtap.store.parquet`
and reads back with its ``read_records`` or with pandas/pyarrow/DuckDB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from batchtap.cli._common import (
    CLIError,
    add_db_arguments,
    add_metrics_option,
    db_url,
    open_store,
    resolve_run,
    run_info,
    run_records,
)
from batchtap.errors import SinkError
from batchtap.records import RunStatus

__all__ = ["register", "main", "export_run"]

EXAMPLE = """examples:
  batchtap export demo --format csv -o demo.csv      # also writes demo.events.csv
  batchtap export demo --format jsonl > demo.jsonl
  batchtap export 3f2a9c --format csv -m loss -m accuracy --rank all -o loss.csv
  batchtap export demo --format parquet -o demo.parquet  # also writes demo.events.parquet

CSV: one row per (step, rank), columns run_id,step,epoch,batch,rank,wall_time,<metrics>; empty
cell = no value, 'nan' = a value that failed validation; events go to <FILE stem>.events.csv and
values logged with tap.log() to <FILE stem>.sparse.csv, one line per value (run_id,step,epoch,
rank,wall_time,name,value) (both with -o only). JSONL: run_start, record, event and run_end lines
(the record codec's; NaN as the string "nan"); a tap.log() record has "sparse": true and only its
own names; batchtap.sinks.jsonl.replay(FILE, sink) feeds the file into another sink.
Parquet (needs -o and pyarrow): one row per record, columns run_id,step,epoch,batch,rank,
wall_time,sparse,<metrics>; a tap.log() record is a row with sparse=true; null = no value, NaN =
a value that failed validation; the run in the file metadata (batchtap.run); events in
<FILE stem>.events.parquet.
Histograms (bt.metrics.Histograms) go to <FILE stem>.histograms.csv with --format csv -o: one line
per layer, kind and captured step (run_id,kind,layer,step,rank,low,high,bin0,bin1,...)."""

Format = Literal["csv", "jsonl", "parquet"]


def _rank(text: str) -> int:
    if text == "all":
        return -1
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rank number or 'all', got {text!r}") from None


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``export`` subcommand."""
    parser = commands.add_parser(
        "export",
        help="write a run's values and events as CSV, JSON lines or Parquet",
        description="Write a stored run's metric values and events as CSV or JSON lines (to FILE or stdout) or Parquet (to FILE).",
        epilog=EXAMPLE,
    )
    parser.add_argument("run", metavar="RUN", help="run id, unique id prefix, or name")
    parser.add_argument("--format", "-f", choices=("csv", "jsonl", "parquet"), required=True, help="output format")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    parser.add_argument("--force", action="store_true", help="replace FILE (and its CSV parts/events) if it exists")
    parser.add_argument(
        "--overwrite-database",
        action="store_true",
        help="with --force, also replace a FILE that is a SQLite database (never the store being read)",
    )
    add_metrics_option(
        parser,
        "only this metric (repeatable; default all)",
    )
    parser.add_argument(
        "--rank", type=_rank, default=None, help="only this rank ('all' = the reduced rows; default every rank)"
    )
    add_db_arguments(parser)
    parser.set_defaults(func=main)


def _outputs(path: Path, fmt: Format) -> list[Path]:
    """Every file an export to ``path`` writes (CSV: parts ``x.2.csv``..., ``x.events.csv`` and
    ``x.sparse.csv``)."""
    if fmt == "jsonl":
        return [path]
    if fmt == "parquet":
        from batchtap.store.parquet import events_path as parquet_events

        return [path, parquet_events(path)]
    from batchtap.sinks.csv import events_path, part_paths, sparse_path

    sidecars = [events_path(path), sparse_path(path), path.with_name(f"{path.stem}.histograms.csv")]
    return [*part_paths(path), *sidecars] if path.exists() else sidecars


_SQLITE_HEADER = b"SQLite format 3\x00"


def _is_sqlite(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER
    except OSError:
        return False


def _store_files(args: argparse.Namespace) -> list[Path]:
    """The files of the SQLite store being read (with its -wal/-shm/-journal); none for PostgreSQL."""
    from batchtap.store.url import parse_url

    try:
        loc = parse_url(db_url(args))
    except Exception:  # noqa: BLE001 - open_store reports a bad URL itself
        return []
    if loc.kind != "sqlite":
        return []
    db = Path(loc.target)
    return [db, *(db.with_name(db.name + suffix) for suffix in ("-wal", "-shm", "-journal"))]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_output(args: argparse.Namespace, path: Path, outputs: list[Path]) -> None:
    """Refuse an output that would destroy data: a directory, the store being read, a database."""
    if path.is_dir():
        raise CLIError(
            f"-o {path} is a directory; expected a file path; fix: name a file in it, e.g. "
            f"-o {path / ('run.' + args.format)}"
        )
    store = _store_files(args)
    for p in outputs:
        if any(_same_file(p, s) for s in store):
            raise CLIError(
                f"-o {p} is the store being read ({store[0]}); exporting onto it would destroy it; "
                "expected a new file; fix: choose another -o"
            )
        if p.exists() and _is_sqlite(p) and not args.overwrite_database:
            raise CLIError(
                f"-o {p} is a SQLite database (maybe a batchtap store); --force does not replace databases; "
                "fix: choose another -o, or add --overwrite-database if it really should be replaced"
            )


def _events_file_even_without_events(path: Path) -> None:
    """The CSV sink opens its events file at the first event; an export writes it in any case
    (its header alone when the run has no events), as the docs promise ``FILE.events.csv``."""
    import csv

    from batchtap.sinks.csv import EVENT_FIELDS, events_path

    target = events_path(path)
    if not target.exists():
        with target.open("w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerow(EVENT_FIELDS)


def export_run(args: argparse.Namespace, fmt: Format, path: Path) -> tuple[int, int, int]:
    """Write the run named by ``args.run`` to ``path``; returns (step records, sparse records,
    events) written."""
    with open_store(args) as store:
        run = resolve_run(store, args.run)
        if args.metrics:
            present = store.metric_names(run.id)
            missing = [m for m in args.metrics if m not in present]
            if missing:
                raise CLIError(
                    f"run {run.name!r} has no values for {', '.join(map(repr, missing))}; it has "
                    f"{', '.join(present) or 'none'}; fix: pick one of those with -m"
                )
        records = run_records(store, run, args.metrics, args.rank)
        events = store.events(run.id)
        histograms = _histograms(store, run.id, args.rank)
    if args.rank is not None:
        events = [e for e in events if e.rank == args.rank]
    if fmt == "parquet":
        from batchtap.store.parquet import write_run

        try:
            write_run(path, run_info(run), records, events)
        except OSError as exc:
            raise CLIError(f"cannot write {path}: {exc.strerror or exc}; fix: choose another -o") from None
        sparse = sum(r.sparse for r in records)
        return len(records) - sparse, sparse, len(events)
    if fmt == "csv":
        from batchtap.sinks.csv import CSV as Writer
    else:
        from batchtap.sinks.jsonl import JSONL as Writer  # type: ignore[assignment]
    info = run_info(run)
    try:
        sink = Writer(path)
    except SinkError as exc:  # names the path and the fix
        raise CLIError(str(exc)) from None
    try:
        sink.start_run(info)
        # One block: the CSV header then holds every metric, so the export is a single file.
        sink.write(records, events)
        if run.status is not RunStatus.RUNNING:
            sink.end_run(info)
    finally:
        sink.close()
    if fmt == "csv":
        _events_file_even_without_events(path)
        if histograms:
            _write_histograms(path.with_name(f"{path.stem}.histograms.csv"), histograms)
    sparse = sum(r.sparse for r in records)
    return len(records) - sparse, sparse, len(events)


def _histograms(store: Any, run_id: str, rank: int | None) -> list[Any]:
    from batchtap.store.histograms import read_histograms

    found = read_histograms(store, run_id)
    return [h for h in found if rank is None or h.rank == rank]


def _write_histograms(path: Path, histograms: list[Any]) -> None:
    """``<FILE stem>.histograms.csv``: one line per layer, kind and captured step (bt.metrics.Histograms)."""
    import csv

    from batchtap.store.histograms import HISTOGRAM_CSV_COLUMNS, histogram_csv_row

    bins = max(len(h.counts) for h in histograms)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*HISTOGRAM_CSV_COLUMNS, *(f"bin{i}" for i in range(bins))])
        writer.writerows(histogram_csv_row(h) for h in histograms)


def main(args: argparse.Namespace) -> int:
    """Export one run; returns the exit status."""
    fmt: Format = args.format
    if fmt == "parquet":
        if not args.output or args.output == "-":
            raise CLIError("--format parquet writes a binary file, not stdout; fix: pass -o FILE.parquet", code=2)
        from batchtap._optional import require

        try:
            require("pyarrow", extra="pandas", purpose="batchtap export --format parquet")
        except ImportError as exc:
            raise CLIError(str(exc)) from None
    if args.output and args.output != "-":
        path = Path(args.output)
        _check_output(args, path, [path])
        outputs = _outputs(path, fmt)
        _check_output(args, path, outputs)
        existing = [p for p in outputs if p.exists()]
        if existing and not args.force:
            # The sinks append; exporting onto an old file would mix two exports.
            raise CLIError(
                f"{existing[0]} exists; expected a new file; fix: pass --force to replace it or choose another -o"
            )
        for p in existing:
            p.unlink()
        n, k, m = export_run(args, fmt, path)
        logged = ""
        if k:
            from batchtap.sinks.csv import sparse_path

            where = (
                f" in {sparse_path(path)}"
                if fmt == "csv"
                else (" as rows with logged=true" if fmt == "parquet" else "")
            )
            logged = f" ({k} records of tap.log() values{where})"
        print(f"wrote {n} records and {m} events to {path}{logged}", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="batchtap-export-") as tmp:
        path = Path(tmp) / f"export.{fmt}"
        export_run(args, fmt, path)
        with path.open("rb") as src:
            shutil.copyfileobj(src, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        if fmt == "csv":
            for kind, sidecar in (("events", "events"), ("tap.log() values", "sparse")):
                if os.path.exists(path.with_name(f"export.{sidecar}.csv")):
                    print(f"({kind} are not in CSV on stdout; use -o FILE to get FILE.{sidecar}.csv)", file=sys.stderr)
    return 0
