"""``batchtap run [--name N] [--db URL] SCRIPT [ARGS...]``: record an unmodified training script.

Runs the script in this process as ``python SCRIPT ARGS`` would (``runpy``, ``sys.argv = [SCRIPT,
*ARGS]``, ``__name__ == "__main__"``, the script's folder first on ``sys.path``: the same set-up
as ``batchtap audit``) with :func:`batchtap.autolog` on: one record per optimizer step, stored
with the script's command line and training-related environment variables as the run's config,
and the console's lines as usual. The run ends as the script does: ``finished`` (exit status 0),
``failed`` (an exception, or a non-zero ``sys.exit``; every captured step is stored), ``stopped``
(Ctrl-C or SIGTERM); the command exits with the script's status. Under ``torchrun`` (``torchrun
--nproc_per_node=2 -m batchtap run train.py``) every rank runs it and rank 0 stores the reduced rows.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from batchtap.cli._common import CLIError
from batchtap.cli.audit import _script_context

__all__ = ["register", "main", "run_script", "training_environment"]

EXAMPLE = """examples:
  batchtap run train.py --epochs 3               # ARGS after SCRIPT go to the script
  batchtap run --name exp1 --db runs/exp.db train.py
  torchrun --nproc_per_node=2 -m batchtap run train.py
  python -m batchtap run train.py

Recorded per optimizer step: loss (from the tensor given to backward()), accuracy (where
cross_entropy/nll_loss saw logits and class targets), lr, gradient norm (pre-clip), step time,
data wait, throughput, AMP loss scale and skips. What autolog cannot see is said once, as a
warning event with the run (batchtap show RUN)."""

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
    parser.add_argument("script", metavar="SCRIPT", help="the Python training script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    parser.set_defaults(func=main)


def training_environment() -> dict[str, str]:
    """The environment variables stored with a run (secrets are masked when the run is stored)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


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
    if args.db:
        os.environ["BATCHTAP_DB"] = args.db  # the default store (and any Tap the script makes itself)
    from batchtap.autolog import active_session, autolog  # torch is imported here, not at CLI start

    config: dict[str, Any] = {
        "script": str(script),
        "argv": [str(script), *args.args],
        "environment": training_environment(),
    }
    with _script_context(script, args.args):
        autolog(name=args.name or script.stem, config=config, flush_every=args.flush_every)
        session = active_session()
        code, status, reason = run_script(script)
        if session is not None:
            session.end(status, reason)
    if reason == "SIGTERM":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # end as SIGTERM would, now that the run is stored
    return code
