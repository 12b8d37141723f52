"""Optional dependencies: import one or fail with the ``pip install`` line that fixes it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, *, extra: str, purpose: str) -> ModuleType:
    """Import an optional dependency or fail with the install command that fixes it.

    Args:
        module: importable module name, e.g. ``"psycopg"``.
        extra: the batchtap extra that installs it, e.g. ``"postgres"``.
        purpose: what needs it, e.g. ``"bt.sinks.Postgres"``.

    Example:
        >>> require("json", extra="none", purpose="doctest").dumps(1)
        '1'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{purpose} needs the optional package {module!r}, which is not installed; "
            f"install it with: pip install 'batchtap[{extra}]'"
        ) from exc
