"""``batchtap replay SPOOL_DIR``: deliver the blocks a run left in its spool to the store now.

A Tap with ``spool_dir`` keeps the blocks a sink could not take (a locked database, a full disk, a
server down) in ``<spool_dir>/NN-<sink>.rank<R>.jsonl`` and replays them when the sink takes writes
again, or when a later ``ResilientSink`` opens the same spool. When the trouble outlasts the run,
the store meanwhile shows the run ``running`` with part of its rows; ``batchtap runs`` and
``batchtap show`` say so (:func:`pending_spools`), and this command delivers them at once.

Only spools of the store's own kind are replayed here (SQLite or PostgreSQL, into ``--db``); a spool
of another sink (CSV, MLflow, ...) is listed with the way to replay it (a Tap with that sink and the
same ``spool_dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from batchtap.cli._common import CLIError, add_db_arguments, db_url, open_store, short_id

__all__ = ["register", "main", "SpoolInfo", "read_spool", "find_spools", "pending_spools", "spool_only_runs"]

EXAMPLE = """examples:
  batchtap replay runs/spool                       # into $BATCHTAP_DB, else runs/batchtap.db
  batchtap replay /scratch/job42/spool --db postgresql://postgres@127.0.0.1/train
  batchtap replay spool --db new.db --create       # into a SQLite file that does not exist yet

A SQLite --db that does not exist is refused (a typo would otherwise get the blocks) unless --create.
Lines of a spool that cannot be read are kept in <spool>.rejected, never deleted; the exit status is
then 1. Exit status: 0 all delivered; 1 something stayed behind, was rejected, or --db does not exist."""

#: ``NN-<sink>.rank<R>.jsonl``: the names ``Tap(spool_dir=...)`` gives its spools
_SPOOL_NAME = re.compile(r"^(\d+)-([a-z0-9_]+)\.rank(\d+)\.jsonl$")
_STORE_SINKS = {"sqlite": "sqlite", "postgres": "postgres"}


@dataclasses.dataclass(frozen=True)
class SpoolInfo:
    """What a spool file holds, read without delivering it.

    Attributes:
        path: the spool file.
        sink: the sink kind from its name (``sqlite``, ``postgres``, ``csv``, ...).
        entries: spooled sink calls (blocks, run starts and ends).
        records: step and ``Tap.log()`` records among them.
        runs: run id -> (first step, last step) of its spooled records (None, None without any).
        ends: the runs whose end (status) is among the spooled calls.
        damaged: lines that cannot be read (a replay keeps them in ``<spool>.rejected``).
        names: run id -> the run's name, where its start is among the spooled calls.
    """

    path: Path
    sink: str
    entries: int
    records: int
    runs: dict[str, tuple[int | None, int | None]]
    ends: frozenset[str]
    damaged: int
    names: dict[str, str] = dataclasses.field(default_factory=dict)


def read_spool(path: Path) -> SpoolInfo | None:
    """A spool's contents, or None when ``path`` is not a pending spool (not named like one, or empty)."""
    match = _SPOOL_NAME.match(path.name)
    if match is None:
        return None
    try:
        if path.stat().st_size == 0:
            return None
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    from batchtap.records import RunEnd, RunStart, Write
    from batchtap.sinks.resilient import decode_entry

    entries = records = damaged = 0
    runs: dict[str, tuple[int | None, int | None]] = {}
    ends: set[str] = set()
    names: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            entry = decode_entry(line)
        except Exception:  # noqa: BLE001 - damaged or from another version: counted, never fatal
            damaged += 1
            continue
        entries += 1
        if isinstance(entry, Write):
            records += len(entry.records)
            for r in entry.records:
                low, high = runs.get(r.run_id, (None, None))
                runs[r.run_id] = (
                    r.step if low is None else min(low, r.step),
                    r.step if high is None else max(high, r.step),
                )
            for e in entry.events:
                runs.setdefault(e.run_id, (None, None))
        elif isinstance(entry, (RunStart, RunEnd)):
            runs.setdefault(entry.run.id, (None, None))
            names.setdefault(entry.run.id, entry.run.name)
            if isinstance(entry, RunEnd):
                ends.add(entry.run.id)
    if not entries and not damaged:
        return None
    return SpoolInfo(path, match.group(2), entries, records, runs, frozenset(ends), damaged, names)


def find_spools(dirs: Iterable[Path], *, depth: int = 3) -> list[SpoolInfo]:
    """The pending spools under ``dirs`` (each searched ``depth`` levels down), by path."""
    found: dict[Path, SpoolInfo] = {}
    for top in dirs:
        if not top.is_dir():
            continue
        stack = [(top, 0)]
        while stack:
            here, level = stack.pop()
            try:
                children = list(os.scandir(here))
            except OSError:
                continue
            for child in children:
                path = Path(child.path)
                if child.is_file() and path.suffix == ".jsonl":
                    info = read_spool(path)
                    if info is not None:
                        found[path.resolve()] = info
                elif child.is_dir(follow_symlinks=False) and level < depth and not child.name.startswith("."):
                    stack.append((path, level + 1))
    return [found[p] for p in sorted(found)]


def spool_search_dirs(args: argparse.Namespace) -> list[Path]:
    """Where ``runs``/``show`` look for spools: ``--spool DIR`` (repeatable), ``$BATCHTAP_SPOOL_DIR``,
    and the directory of a SQLite store (``Tap(spool_dir=...)`` next to the database is the usual
    place: the demo's ``runs/spool``)."""
    dirs = [Path(d) for d in (getattr(args, "spool", None) or [])]
    env = os.environ.get("BATCHTAP_SPOOL_DIR")
    if env:
        dirs.append(Path(env))
    url = db_url(args)
    if not url.startswith(("postgresql://", "postgres://")):
        dirs.append(Path(url.removeprefix("sqlite:///")).resolve().parent)
    return dirs


def pending_spools(args: argparse.Namespace) -> dict[str, list[SpoolInfo]]:
    """Run id -> the pending spools holding some of it (see :func:`spool_search_dirs`)."""
    out: dict[str, list[SpoolInfo]] = {}
    for info in find_spools(spool_search_dirs(args)):
        for run_id in info.runs:
            out.setdefault(run_id, []).append(info)
    return out


def spool_only_runs(spools: dict[str, list[SpoolInfo]], stored: Iterable[str]) -> list[str]:
    """Lines about the runs that exist only in pending spools (the store never took their start):
    without them such a run would be invisible until replayed."""
    known = set(stored)
    out = []
    for run_id, infos in sorted(spools.items()):
        if run_id in known:
            continue
        name = next((i.names[run_id] for i in infos if run_id in i.names), "?")
        firsts = [first for i in infos if (first := i.runs[run_id][0]) is not None]
        lasts = [last for i in infos if (last := i.runs[run_id][1]) is not None]
        steps = f"steps {min(firsts)}..{max(lasts)}" if firsts else "no steps"
        where = ", ".join(sorted({str(i.path.parent) for i in infos}))
        out.append(
            f"{name!r} ({short_id(run_id)}): only in a pending spool ({steps}), not in the store yet; "
            f"`batchtap replay {where}` delivers it"
        )
    return out


def describe(info: SpoolInfo, run_id: str | None = None) -> str:
    """One line about a spool (and what it holds of ``run_id``)."""
    what = f"{info.entries} spooled calls, {info.records} records"
    if run_id is not None:
        first, last = info.runs.get(run_id, (None, None))
        if first is not None:
            what += f", steps {first}..{last} of this run"
        if run_id in info.ends:
            what += ", its end"
    if info.damaged:
        what += f", {info.damaged} damaged lines"
    return f"{info.path} ({info.sink} sink: {what})"


def add_spool_argument(parser: argparse.ArgumentParser) -> None:
    """``--spool DIR`` for ``runs`` and ``show``."""
    parser.add_argument(
        "--spool",
        action="append",
        metavar="DIR",
        help="also look for pending spools (Tap(spool_dir=...)) under DIR (repeatable; default: $BATCHTAP_SPOOL_DIR "
        "and the SQLite store's directory)",
    )


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``replay`` subcommand."""
    parser = commands.add_parser(
        "replay",
        help="deliver a spool's pending blocks to the store now",
        description="Deliver the blocks a run left in its spool (Tap(spool_dir=...)) to the store now, in order, "
        "then remove the spool (what still fails stays in it). Spools of the store's kind (SQLite or PostgreSQL) "
        "are replayed into --db; others are listed with how to replay them.",
        epilog=EXAMPLE,
    )
    parser.add_argument("spool_dir", metavar="SPOOL_DIR", help="the Tap's spool_dir")
    add_db_arguments(parser)
    parser.add_argument(
        "--force",
        action="store_true",
        help="replay even when a run in the spool is still running (its process may still be spooling)",
    )
    parser.add_argument(
        "--create",
        action="store_true",
        help="create the SQLite store when --db names a file that does not exist (refused otherwise)",
    )
    parser.set_defaults(func=main)


def _store_sink(args: argparse.Namespace):  # type: ignore[no-untyped-def]  # a Sink; sinks import lazily
    from batchtap.errors import SinkError

    url = db_url(args)
    schema = args.schema or os.environ.get("BATCHTAP_DB_SCHEMA") or None
    try:
        if url.startswith(("postgresql://", "postgres://")):
            from batchtap.sinks.postgres import Postgres

            return "postgres", Postgres(url, schema=schema)
        from batchtap.sinks.sqlite import SQLite

        return "sqlite", SQLite(url.removeprefix("sqlite:///"))
    except SinkError as exc:
        raise CLIError(str(exc)) from None


def _running(args: argparse.Namespace, run_ids: Sequence[str]) -> list[str]:
    """The runs among ``run_ids`` the store shows running (their process alive, or unknown)."""
    from batchtap.records import RunStatus
    from batchtap.store import RunNotFound

    out = []
    with open_store(args) as store:
        for run_id in run_ids:
            try:
                run = store.run(run_id)
            except RunNotFound:
                continue
            if run.status is RunStatus.RUNNING:
                out.append(f"{run.name!r} ({short_id(run.id)}, pid {run.environment.get('pid')})")
    return out


def main(args: argparse.Namespace) -> int:
    """Replay the spools under SPOOL_DIR; returns the exit status."""
    top = Path(args.spool_dir)
    if not top.is_dir():
        raise CLIError(f"spool directory {top} does not exist; expected the Tap's spool_dir; fix: check the path")
    spools = find_spools([top], depth=0)
    if not spools:
        print(f"no pending spools in {top}")
        return 0
    url = db_url(args)
    if not url.startswith(("postgresql://", "postgres://")) and not getattr(args, "create", False):
        target = Path(url.removeprefix("sqlite:///"))
        if not target.exists():
            raise CLIError(
                f"no store at {target}: replay delivers into an existing store; expected the --db the run "
                f"wrote to; fix: check the path, or pass --create to make a new store there"
            )
    kind, sink = _store_sink(args)
    mine = [s for s in spools if _STORE_SINKS.get(s.sink) == kind]
    others = [s for s in spools if s not in mine]
    try:
        if mine and not args.force:
            busy = _running(args, sorted({r for s in mine for r in s.runs if r not in s.ends}))
            if busy:
                raise CLIError(
                    f"run {', '.join(busy)} still says 'running' and its process may still be spooling into {top}; "
                    "replaying now would interleave with it; fix: wait for the run to end, or pass --force if its "
                    "process is gone"
                )
        failed = rejected = 0
        from batchtap.sinks.resilient import ResilientSink

        for info in mine:
            # Opening the spool replays it (the "left by an earlier run" path of every ResilientSink),
            # in order; what the store still refuses stays in the spool.
            resilient = ResilientSink(sink, spool_path=info.path, retry_initial=0.0)
            for event in resilient.take_events():
                print(f"  {event.message}")
            left = resilient.pending  # nothing is appended to the spool here: no handle is open
            if resilient.rejected:
                rejected += resilient.rejected
                print(
                    f"{info.path}: {resilient.rejected} damaged line(s) could not be read and were not delivered; "
                    f"kept in {resilient.rejected_path}"
                )
            if left:
                failed += 1
                print(
                    f"{info.path}: replayed {resilient.replayed} of {info.entries} calls; the rest stays in the spool"
                )
            else:
                print(
                    f"{info.path}: replayed {resilient.replayed} calls ({info.records} records) into {sink_where(args)}"
                )
    finally:
        try:
            sink.close()
        except Exception:  # noqa: BLE001 - closing a store we only replayed into cannot lose anything
            pass
    for info in others:
        print(
            f"{info.path}: not replayed here: it holds blocks of a {info.sink} sink, not of the {kind} store; fix: "
            f"start a Tap with that sink and spool_dir={top} (it replays the spool when it opens)"
        )
    return 1 if failed or others or rejected else 0


def sink_where(args: argparse.Namespace) -> str:
    from batchtap.store.url import redact_dsn

    return redact_dsn(db_url(args))
