"""``batchtap ui``: serve a live browser view of the store's runs (read-only)."""

from __future__ import annotations

import argparse
import errno
import os
import socket

from batchtap.cli._common import CLIError, add_db_arguments, db_url

__all__ = ["register", "main"]

EXAMPLE = """examples:
  batchtap ui                                   # runs/batchtap.db at http://127.0.0.1:8080/
  batchtap ui --db runs/batchtap.db --port 9000
  batchtap ui --db postgresql://postgres@db/train --host 0.0.0.0    # prints a link with ?token=...

Needs: pip install 'batchtap[ui]'. The store is opened read-only; a running run's charts grow as it
trains. Any --host but loopback requires a token (generated and printed, or --token)."""


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``ui`` subcommand."""
    parser = commands.add_parser(
        "ui",
        help="browse the runs in a browser: live charts, events, compare",
        description="Serve a browser view of a store's runs (SQLite or PostgreSQL, read-only): a runs table, "
        "one page per run with live charts and events, and runs overlaid to compare.",
        epilog=EXAMPLE,
    )
    add_db_arguments(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; any other needs a token)"
    )
    parser.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks a free one)")
    parser.add_argument(
        "--token",
        default=None,
        help="require this token on every request (default: generated when --host is not loopback)",
    )
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C."""
    from batchtap.errors import ConfigError
    from batchtap.store import StoreError

    try:
        import batchtap.ui
    except ImportError as exc:  # pragma: no cover - the message names the extra
        raise CLIError(str(exc)) from None
    if args.token is not None and not args.token:
        raise CLIError("--token must not be empty; fix: give a token, or leave --token out to have one generated")
    _check_port(args.host, args.port)
    try:
        batchtap.ui.serve(
            db_url(args),
            host=args.host,
            port=args.port,
            token=args.token,
            schema=args.schema or os.environ.get("BATCHTAP_DB_SCHEMA") or None,
        )
    except (StoreError, ConfigError) as exc:  # a missing store, a token that cannot travel
        raise CLIError(str(exc)) from None
    except ImportError as exc:
        raise CLIError(str(exc)) from None
    except OSError as exc:
        raise CLIError(f"cannot serve on {args.host}:{args.port}: {exc}; fix: pick another --port") from None
    return 0


def _bindable(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (as uvicorn binds it: SO_REUSEADDR, so a port left
    in TIME_WAIT by a stopped server counts as free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _check_port(host: str, port: int) -> None:
    """A taken port is a user error naming the next free one (uvicorn would log its own error and
    exit 1 with no hint)."""
    if port == 0:
        return
    try:
        if _bindable(host, port):
            return
    except OSError as exc:
        raise CLIError(f"cannot serve on {host}:{port}: {exc.strerror or exc}; fix: check --host") from None
    free = next((p for p in range(port + 1, min(port + 100, 65536)) if _bindable(host, p)), None)
    hint = f"batchtap ui --port {free} (free now)" if free is not None else "another --port"
    raise CLIError(
        f"port {port} on {host} is already in use (another batchtap ui, or another server); expected a free "
        f"port; fix: {hint}, or --port 0 to pick any free port"
    )
