"""Storing what fits of a block when part of it is refused for what it holds.

A store refuses a block for a *data* reason (a name PostgreSQL text cannot hold, a value out of
range) the same way every time, so retrying the block is useless and holding it back would block
every later one. Instead the block is split in halves, recursively, each part in its own
transaction: every row the store accepts is stored, and the few it refuses are returned to be
reported. Rows are upserts keyed by (run, metric, step, rank) or event key, so a part stored
twice (after a reconnect) stores nothing twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Row", "store_what_fits", "describe_rejected"]

#: (table, row): "runs" (placeholder run rows), "metrics", "sparse" or "events"
Row = tuple[str, tuple[Any, ...]]


def store_what_fits(
    rows: Sequence[Row], write: Callable[[Sequence[Row]], None], is_data_error: Callable[[BaseException], bool]
) -> list[tuple[Row, BaseException]]:
    """Write ``rows`` in parts; return the rows the store refused, each with its error.

    ``write`` stores a sequence of rows in one transaction. An error ``is_data_error`` does not
    accept (the store went away) propagates: the caller retries the whole block later.

    Example:
        >>> got = []
        >>> def write(rows):
        ...     if any("\\x00" in r[1][0] for r in rows):
        ...         raise ValueError("NUL")
        ...     got.extend(rows)
        >>> bad = store_what_fits([("metrics", ("a",)), ("metrics", ("b\\x00",)), ("metrics", ("c",))], write,
        ...                       lambda e: isinstance(e, ValueError))
        >>> [r[1][0] for r in got], [r[1][0] for r, _ in bad]
        (['a', 'c'], ['b\\x00'])
    """
    rejected: list[tuple[Row, BaseException]] = []
    stack = [list(rows)]
    while stack:
        part = stack.pop()
        if not part:
            continue
        try:
            write(part)
        except Exception as exc:
            if not is_data_error(exc):
                raise
            if len(part) == 1:
                rejected.append((part[0], exc))
                continue
            mid = len(part) // 2
            stack += [part[mid:], part[:mid]]  # first half first: keep the order of the block
    return rejected


def describe_rejected(rejected: Sequence[tuple[Row, BaseException]], *, sink: str, total: int) -> str:
    """One message naming what a sink refused and why, grouped by name (names shown escaped,
    e.g. ``\\x00``)."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    reasons: dict[tuple[str, str, str], str] = {}
    for (table, row), exc in rejected:
        if table == "metrics":
            key = (table, f"value {row[1]!r}", str(row[0]))
            step = int(row[2])
        elif table == "sparse":
            key, step = (table, f"logged name {row[1]!r}", str(row[0])), -1
        elif table == "events":
            key, step = (table, "event", str(row[0])), int(row[2])
        else:
            key, step = (table, "run row", str(row[0])), -1
        groups.setdefault(key, []).append(step)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reasons.setdefault(key, text)
    parts = []
    for key, steps in list(groups.items())[:5]:
        _, what, run_id = key
        shown = [s for s in steps if s >= 0]
        where = f", steps {min(shown)}..{max(shown)}" if shown else ""
        parts.append(f"{what} of run {run_id!r} ({len(steps)} rows{where}): {reasons[key]}")
    more = f"; and {len(groups) - 5} more names" if len(groups) > 5 else ""
    return (
        f"sink {sink} refused {len(rejected)} of {total} rows of a block for what they hold: "
        f"{'; '.join(parts)}{more}; the rest of the block is stored; fix: use names and values the "
        "store can hold (no NUL characters)"
    )
