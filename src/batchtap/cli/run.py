"""``batchtap run [--name N] [--db URL] SCRIPT [ARGS...]``: record an unmodified training script.

Runs the script in this process as ``python SCRIPT ARGS`` would (``runpy``, ``sys.argv = [SCRIPT,
*ARGS]``, ``__name__ == "__main__"``, the script's folder first on ``sys.path``: the same set-up
as ``batchtap audit``) with :func:`batchtap.autolog` on: one record per optimizer step, stored
with the script's parsed arguments as the run's config (what its ``argparse`` parser returned for
the command line: ``batchtap run train.py --lr 0.01`` stores ``lr``; a Hydra app's config with its
overrides, ``batchtap run train.py optimizer.lr=0.01``, stores ``optimizer.lr``; stored as soon as the
script has them), its command line and
training-related environment variables, and the console's lines as usual. The run ends as the script does: ``finished`` (exit status 0),
``failed`` (an exception, or a non-zero ``sys.exit``; every captured step is stored), ``stopped``
(Ctrl-C or SIGTERM); the command exits with the script's status. Under ``torchrun`` (``torchrun
--nproc_per_node=2 -m batchtap run train.py``) every rank runs it and rank 0 stores the reduced rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from batchtap._defaults import store_url
from batchtap.cli._common import CLIError
from batchtap.cli._configs import ConfigHooks
from batchtap.cli.audit import _script_context

__all__ = ["register", "main", "run_script", "training_environment", "ParsedArguments"]

EXAMPLE = """examples:
  batchtap run train.py --epochs 3               # ARGS after SCRIPT go to the script
  batchtap run --name exp1 --db runs/exp.db train.py
  torchrun --nproc_per_node=2 -m batchtap run train.py
  python -m batchtap run train.py

Recorded per optimizer step: loss (from the tensor given to backward()), accuracy (where
cross_entropy/nll_loss saw logits and class targets), lr, gradient norm (pre-clip), step time,
data wait, throughput, AMP loss scale and skips. What autolog cannot see is said once, as a
warning event with the run; how it read the loop (accumulation, several losses)
as a note, an info event (batchtap show RUN lists both)."""

#: environment variables stored with the run: the ones that change what a training run does
_ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "HF_", "ACCELERATE_", "BATCHTAP_")
_ENV_NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``run`` subcommand."""
    parser = commands.add_parser(
        "run",
        help="run an unmodified training script with batchtap recording every optimizer step",
        description=__doc__,
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--name", help="the run's name (default: the script's name)")
    parser.add_argument(
        "--db",
        metavar="URL",
        help="store: SQLite path, sqlite:///path or postgresql://user@host/db (default: $BATCHTAP_DB, "
        "else runs/batchtap.db)",
    )
    parser.add_argument(
        "--flush-every", type=int, default=50, metavar="N", help="rows per flush to the store (default 50)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="also record grad_norm/<layer>, weight_norm/<layer> and update_ratio/<layer> every N optimizer steps",
    )
    parser.add_argument(
        "--tag", action="append", dest="tags", default=None, metavar="TAG", help="a tag for the run (repeatable)"
    )
    parser.add_argument("--notes", default=None, metavar="TEXT", help="a note stored with the run")
    parser.add_argument("script", metavar="SCRIPT", help="the Python training script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    parser.set_defaults(func=main)


def training_environment() -> dict[str, str]:
    """The environment variables stored with a run (secrets are masked when the run is stored)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


class ParsedArguments:
    """Catches what the script's ``argparse`` parsers return for its command line, while installed.

    ``ArgumentParser.parse_args`` (and ``parse_known_args``, which it calls) is wrapped for the
    duration of the script: each parse of the command line itself (``args=None``) hands its
    namespace to ``on_parsed``. Parses of explicit lists (subparsers, a script's own helpers) are
    left alone. The wrapper only reads the result; what the script gets back is unchanged.
    """

    def __init__(self, on_parsed: Any) -> None:
        self._on_parsed = on_parsed
        self._original: Any = None

    def __enter__(self) -> ParsedArguments:
        original = self._original = argparse.ArgumentParser.parse_known_args
        on_parsed = self._on_parsed

        def parse_known_args(parser: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
            result = original(parser, args, namespace)
            if args is None and not _hydras_own_parse():
                try:
                    on_parsed(vars(result[0]))
                except Exception as exc:  # noqa: BLE001 - recording the config never breaks the script
                    print(f"batchtap: note: the script's arguments were not stored: {exc}", file=sys.stderr)
            return result

        argparse.ArgumentParser.parse_known_args = parse_known_args  # type: ignore[method-assign, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        argparse.ArgumentParser.parse_known_args = self._original  # type: ignore[method-assign]


def _hydras_own_parse() -> bool:
    """Whether the parse under way is Hydra's own command line (its overrides and flags): the
    config Hydra makes of them is what :class:`~batchtap.cli._configs.ConfigHooks` stores."""
    frame: Any = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == "argparse":
        frame = frame.f_back  # parse_args() calls parse_known_args()
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith("hydra.")


def _store_arguments(session: Any, config: dict[str, Any], parsed: dict[str, Any]) -> None:
    """Put the script's parsed arguments (or its Hydra / OmegaConf config, flattened) into its
    run's config: top-level keys, so they are the runs table's columns; ``script``, ``argv`` and
    ``environment`` stay batchtap's. Stored at once, so a live (or killed) run shows them: before
    the run starts (torchrun: at the process group) they go into ``config``, the run's start
    stores; after, the run's row in its stores is updated now (and written again at its end)."""
    from batchtap._config import to_json_config
    from batchtap._env import scrub_secrets

    values, _ = to_json_config(parsed)
    values = scrub_secrets(values)  # an --api-key argument is never stored
    named = {f"args.{key}" if key in ("script", "argv", "environment") else key: value for key, value in values.items()}
    info = session.tap.run_info if session is not None else None
    if info is None:
        config.update(named)
        return
    info.config.update(named)
    _write_config(session.tap.sinks, info.id, info.config)


def _write_config(sinks: Any, run_id: str, config: dict[str, Any]) -> None:
    """The run's config into the run's row of each SQL store its sinks write (one statement each,
    as ``batchtap tag`` writes tags; the sink's own end-of-run write agrees). Rank 0 only: the
    other ranks' rows are reduced into its run."""
    from batchtap._resume import sql_stores
    from batchtap.store.connect import connect_postgres, connect_sqlite

    if os.environ.get("RANK", "0") != "0":  # torchrun's rank
        return
    text = json.dumps(config, default=str)
    for kind, where, schema in sql_stores(sinks):
        if kind == "sqlite" and not os.path.exists(where):
            continue  # moved away under a relative path: the run's end writes its config
        if kind == "sqlite":
            conn = connect_sqlite(where, create=True)  # the sink made it at the run's start
            sql = "UPDATE runs SET config = ? WHERE id = ?"
        else:
            conn = connect_postgres(where, schema=schema, create=False, purpose="batchtap run")
            sql = "UPDATE runs SET config = %s WHERE id = %s"
        try:
            conn.execute(sql, (text, run_id))
        finally:
            conn.close()


def _absolute(url: str) -> str:
    """A SQLite store's path (plain or ``sqlite:///``) made absolute; a PostgreSQL URL (or one the
    store refuses, said when the run opens it) as it is."""
    from batchtap.store.url import parse_url

    try:
        loc = parse_url(url)
    except Exception:  # noqa: BLE001 - the sink names what is wrong with it, with the fix
        return url
    return os.path.abspath(loc.target) if loc.kind == "sqlite" else url


def run_script(script: Path) -> tuple[int, str, str | None]:
    """Run ``script`` as ``__main__``: (exit status, run status, reason). A traceback goes to stderr."""
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return 0, "finished", None
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        return code, "failed", f"the script exited with status {code}"
    except KeyboardInterrupt:
        return 130, "stopped", "KeyboardInterrupt"
    except BaseException as exc:  # noqa: BLE001 - whatever the script raised, its run is stored first
        if type(exc).__name__ in ("_Terminated", "Terminated"):  # the Tap's SIGTERM handler
            return 128 + signal.SIGTERM, "stopped", "SIGTERM"
        traceback.print_exc()
        first = (str(exc).splitlines() or [""])[0]
        return 1, "failed", f"{type(exc).__name__}{': ' + first if first else ''}"
    return 0, "finished", None


def main(args: argparse.Namespace) -> int:
    """Run one script under autolog; returns the script's exit status."""
    script = Path(args.script)
    if not script.is_file():
        raise CLIError(f"no script {args.script!r}: expected a Python file to run; fix: check the path")
    if args.flush_every < 1:
        raise CLIError(f"--flush-every must be >= 1, got {args.flush_every}", code=2)
    if args.layers is not None and args.layers < 1:
        raise CLIError(f"--layers must be >= 1 (record every N-th optimizer step), got {args.layers}", code=2)
    # The default store (and any Tap the script makes itself), a SQLite path made absolute: a script
    # that changes its working directory (a Hydra app with hydra.job.chdir) keeps writing there.
    os.environ["BATCHTAP_DB"] = _absolute(args.db or store_url())
    from batchtap.autolog import active_session, autolog  # torch is imported here, not at CLI start

    config: dict[str, Any] = {
        "script": str(script),
        "argv": [str(script), *args.args],
        "environment": training_environment(),
    }
    with _script_context(script, args.args):
        autolog(name=args.name or script.stem, config=config, flush_every=args.flush_every, layers=args.layers)
        session = active_session()
        info = session.tap.run_info if session is not None else None
        if info is not None and (args.tags or args.notes):
            info.environment["tags"] = list(dict.fromkeys(args.tags or ()))
            if args.notes:
                info.environment["notes"] = args.notes
        store = functools.partial(_store_arguments, session, config)
        with ParsedArguments(store), ConfigHooks(store):
            code, status, reason = run_script(script)
        if session is not None:
            session.end(status, reason)
    if reason == "SIGTERM":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # end as SIGTERM would, now that the run is stored
    return code
