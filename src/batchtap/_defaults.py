"""Defaults shared by the Tap and the CLI (no torch import here: the CLI starts without torch)."""

from __future__ import annotations

import os

__all__ = ["DEFAULT_DB", "store_url"]

#: where runs are stored when nothing else is said: SQLite, relative to the working directory
DEFAULT_DB = os.path.join("runs", "batchtap.db")


def store_url() -> str:
    """The store a Tap without ``sinks=`` writes to and the CLI reads: ``$BATCHTAP_DB``, else
    :data:`DEFAULT_DB`."""
    return os.environ.get("BATCHTAP_DB") or DEFAULT_DB
