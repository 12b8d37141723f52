"""``batchtap tag RUN``: set a run's tags and note (the browser view shows them, read-only)."""

from __future__ import annotations

import argparse
import json
import os

from batchtap.cli._common import CLIError, add_db_arguments, db_url, open_store, resolve_run, short_id
from batchtap.records import RunStatus

__all__ = ["register", "main"]

EXAMPLE = """examples:
  batchtap tag 3f2a9c01 --add baseline --add lr-sweep
  batchtap tag demo --remove lr-sweep --notes "diverged at step 50; lr too high"
  batchtap tag demo                   # print the tags and note

Tags and a note can also be given at the start: batchtap run --tag T --notes TEXT train.py.
Filter on them in the browser view: tag=baseline and status=finished."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``tag`` subcommand."""
    parser = commands.add_parser(
        "tag",
        help="set a run's tags and note",
        description="Add or remove a run's tags and set its note. RUN is an id, a unique id prefix "
        "(the 8-character short id) or a name (the latest run of that name). A run that is still "
        "running is refused: its end writes its row again.",
        epilog=EXAMPLE,
    )
    parser.add_argument("run", metavar="RUN", help="run id, unique id prefix, or name")
    add_db_arguments(parser)
    parser.add_argument("--add", action="append", default=[], metavar="TAG", help="add a tag (repeatable)")
    parser.add_argument("--remove", action="append", default=[], metavar="TAG", help="remove a tag (repeatable)")
    parser.add_argument("--notes", default=None, metavar="TEXT", help="set the note ('' clears it)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Change (or print) a run's tags and note; returns the exit status."""
    for tag in args.add:
        if not tag.strip() or len(tag) > 100:
            raise CLIError(f"a tag must be 1 to 100 characters, not blank, got {tag!r}; fix: give a short word")
    with open_store(args) as store:
        run = resolve_run(store, args.run)
    if not (args.add or args.remove or args.notes is not None):
        print(f"run {run.name} ({short_id(run.id)})")
        print(f"  tags   {', '.join(run.tags) or '(none)'}")
        print(f"  notes  {run.notes or '(none)'}")
        return 0
    if run.status is RunStatus.RUNNING:
        raise CLIError(
            f"run {run.name!r} ({short_id(run.id)}) is still running: its end writes its row again and would "
            "drop tags set now; fix: tag it once it has ended, or start it with batchtap run --tag/--notes"
        )
    tags = [t for t in dict.fromkeys([*run.tags, *args.add]) if t not in set(args.remove)]
    environment = dict(run.environment, tags=tags)
    if args.notes is not None:
        if args.notes:
            environment["notes"] = args.notes
        else:
            environment.pop("notes", None)
    _write_environment(args, run.id, environment)
    print(f"run {run.name} ({short_id(run.id)}): tags {', '.join(tags) or '(none)'}")
    return 0


def _write_environment(args: argparse.Namespace, run_id: str, environment: dict[str, object]) -> None:
    """The one write of the CLI outside ``replay``: the run's environment (where its tags and
    note live), in one statement."""
    from batchtap.store import StoreError, parse_url
    from batchtap.store.connect import connect_postgres, connect_sqlite

    loc = parse_url(db_url(args))
    text = json.dumps(environment, default=str)
    try:
        if loc.kind == "sqlite":
            conn = connect_sqlite(loc.target, create=False)
            conn.close()  # it exists and is a batchtap store (a reader never creates one)
            conn = connect_sqlite(loc.target, create=True)
            sql = "UPDATE runs SET environment = ? WHERE id = ?"
        else:
            schema = args.schema or os.environ.get("BATCHTAP_DB_SCHEMA") or None
            conn = connect_postgres(loc.target, schema=schema, create=False, purpose="batchtap tag")
            sql = "UPDATE runs SET environment = %s WHERE id = %s"
    except StoreError as exc:
        raise CLIError(str(exc)) from None
    try:
        conn.execute(sql, (text, run_id))
    finally:
        conn.close()
