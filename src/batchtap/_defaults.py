"""Defaults shared by the Tap and the CLI (no torch import here: the CLI starts without torch)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from batchtap.errors import ConfigError

if TYPE_CHECKING:
    from batchtap.sinks.base import Sink

__all__ = ["DEFAULT_DB", "checked_sinks", "default_sinks", "store_url"]

#: where runs are stored when nothing else is said: SQLite, relative to the working directory
DEFAULT_DB = os.path.join("runs", "batchtap.db")


def store_url() -> str:
    """The store a Tap without ``sinks=`` writes to and the CLI reads: ``$BATCHTAP_DB``, else
    :data:`DEFAULT_DB`."""
    return os.environ.get("BATCHTAP_DB") or DEFAULT_DB


def checked_sinks(sinks: Sequence[Sink], spool_dir: str | os.PathLike[str] | None, *, rank: int) -> list[Sink]:
    """The Tap's sinks, each wrapped in a spooling ResilientSink when ``spool_dir`` is given."""
    from batchtap.sinks.base import Sink

    for sink in sinks:
        if not isinstance(sink, Sink):
            raise ConfigError(
                f"sinks must be batchtap.sinks.Sink objects, got {type(sink).__name__}; fix: subclass "
                "batchtap.sinks.Sink and implement write(records, events)"
            )
    if spool_dir is None:
        return list(sinks)
    from batchtap.sinks.resilient import ResilientSink

    return [
        ResilientSink(sink, spool_path=Path(spool_dir) / f"{i:02d}-{type(sink).__name__.lower()}.rank{rank}.jsonl")
        for i, sink in enumerate(sinks)
    ]


def default_sinks() -> list[Sink]:
    """SQLite at ``$BATCHTAP_DB`` (else ``runs/batchtap.db``; a PostgreSQL URL there means
    PostgreSQL) plus the console: a run is stored and visible without any configuration."""
    from batchtap.sinks.console import Console

    url = store_url()
    store: Sink
    if url.startswith(("postgresql://", "postgres://")):
        from batchtap.sinks.postgres import Postgres

        store = Postgres(url)
    else:
        from batchtap.sinks.sqlite import SQLite

        store = SQLite(url.removeprefix("sqlite:///"))
    return [store, Console()]
