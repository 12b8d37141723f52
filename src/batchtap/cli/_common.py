"""What the store-reading subcommands share: ``--db``, opening the store, resolving ``RUN``, tables.

Every subcommand reports a user error by raising :class:`CLIError`; ``main`` prints it and exits
with its code (1), so a subcommand never calls ``sys.exit`` itself.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import textwrap
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from batchtap._defaults import DEFAULT_DB, store_url
from batchtap._units import number
from batchtap.records import ALL_RANKS, Event, EventKind, Record, RunInfo
from batchtap.store import RunNotFound, StoreError

if TYPE_CHECKING:
    from batchtap.store import RunRow, Store

__all__ = [
    "DEFAULT_DB",
    "CLIError",
    "add_db_arguments",
    "add_metrics_option",
    "db_url",
    "open_store",
    "resolve_run",
    "pick_metrics",
    "run_info",
    "run_records",
    "events_by_kind",
    "fmt_value",
    "fmt_duration",
    "fmt_time",
    "fmt_rank",
    "table",
    "fit_table",
    "wrap",
    "terminal_width",
    "short_id",
    "plain_text",
    "HelpFormatter",
]


class CLIError(Exception):
    """A user error: printed as ``batchtap: error: <message>``, exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def add_metrics_option(parser: argparse.ArgumentParser, help: str) -> None:  # noqa: A002 - argparse's word
    """Add ``-m``/``--metric NAME`` (repeatable, gathered in ``args.metrics``) with the subcommand's ``help``."""
    parser.add_argument("-m", "--metric", action="append", dest="metrics", metavar="NAME", help=help)


def add_db_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--db`` and ``--schema`` to a subcommand that reads a store."""
    parser.add_argument(
        "--db",
        metavar="URL",
        default=None,
        help=f"store: SQLite path, sqlite:///path or postgresql://user@host/db "
        f"(default: $BATCHTAP_DB, else {DEFAULT_DB})",
    )
    parser.add_argument(
        "--schema",
        default=None,
        help="PostgreSQL schema holding the tables (default: $BATCHTAP_DB_SCHEMA, else the server's search_path)",
    )


def db_url(args: argparse.Namespace) -> str:
    """The store URL: ``--db``, else the default store (:func:`batchtap._defaults.store_url`)."""
    return str(args.db or store_url())


def open_store(args: argparse.Namespace) -> Store:
    """Open the store named by ``--db``/``--schema`` (or their environment variables).

    Raises:
        CLIError: the store is missing, unreachable, or not a batchtap store.
    """
    import batchtap.store

    url = db_url(args)
    schema = args.schema or os.environ.get("BATCHTAP_DB_SCHEMA") or None
    try:
        return batchtap.store.open(url, schema=schema)
    except StoreError as exc:
        hint = ""
        if url == DEFAULT_DB and not os.path.exists(url):
            hint = " (the default store; run `batchtap demo` to make one, or pass --db / set BATCHTAP_DB)"
        raise CLIError(f"{exc}{hint}") from None


def resolve_run(store: Store, ref: str) -> RunRow:
    """The run ``ref`` names: an id, a unique id prefix, or a name (the latest run of it wins).

    Raises:
        CLIError: no run matches (the message lists the closest names) or the prefix is ambiguous.
    """
    try:
        return store.run(ref)
    except RunNotFound as exc:
        raise CLIError(str(exc)) from None


def pick_metrics(store: Store, run: RunRow, wanted: Sequence[str] | None, default: Sequence[str]) -> list[str]:
    """The metrics to show: ``wanted`` (each must exist), else those of ``default`` the run has,
    else its first stored metric.

    Raises:
        CLIError: a wanted metric has no values in the run, or the run has none at all.
    """
    present = store.metric_names(run.id)
    sparse = set(store.sparse_names(run.id))
    if wanted:
        missing = [m for m in wanted if m not in present]
        if missing:
            raise CLIError(
                f"run {run.name!r} ({short_id(run.id)}) has no values for {', '.join(map(repr, missing))}; "
                f"it has {', '.join(present) or 'no metrics yet'}; fix: pick one of those with -m"
            )
        return list(dict.fromkeys(wanted))
    chosen = [m for m in default if m in present]
    if not chosen and present:
        # a step metric rather than a Tap.log() name when the run has both
        chosen = [m for m in present if m not in sparse][:1] or present[:1]
    if not chosen:
        raise CLIError(f"run {run.name!r} ({short_id(run.id)}) has no stored metric values yet")
    return chosen


def run_info(run: RunRow) -> RunInfo:
    """The :class:`~batchtap.records.RunInfo` a sink would have been given for a stored run."""
    return RunInfo(
        id=run.id,
        name=run.name,
        config=dict(run.config),
        started_at=run.started_at,
        status=run.status,
        ended_at=run.ended_at,
        stop_reason=run.stop_reason,
        world_size=run.world_size,
        environment=dict(run.environment),
        metrics=tuple(run.metrics),
    )


def run_records(
    store: Store, run: RunRow, metrics: Sequence[str] | None = None, rank: int | None = None
) -> list[Record]:
    """A stored run turned back into the records its sinks were given, in (step, rank) order; the
    sparse records (``Tap.log()`` values, ``sparse=True``) follow the step records of their step.

    Args:
        store: the open store.
        run: the run.
        metrics: which metrics, step or sparse (default: all with stored values).
        rank: one rank only (``-1`` for the all-ranks rows); default every rank stored.
    """
    names = list(metrics) if metrics else store.metric_names(run.id)
    sparse = set(store.sparse_names(run.id))
    logged = [n for n in names if n in sparse]
    names = [n for n in names if n not in sparse]
    wanted = set(names)
    # The reading API gives positions (epoch, batch, wall time) per (metric, rank) series, so find
    # which ranks each metric has first; one pass over the run's values.
    pairs: dict[tuple[str, int], None] = {}
    for metric, _step, r, _value in store.iter_metrics(run.id):
        if metric in wanted and (rank is None or r == rank):
            pairs[(metric, r)] = None
    rows: dict[tuple[int, int], tuple[int, int, float, dict[str, float]]] = {}
    order = {name: i for i, name in enumerate(names)}
    for metric, r in sorted(pairs, key=lambda p: (order[p[0]], p[1])):
        for p in store.series(run.id, metric, rank=r):
            key = (p.step, r)
            if key not in rows:
                rows[key] = (p.epoch, p.batch, p.wall_time, {})
            rows[key][3][metric] = p.value
    records = [
        Record(run.id, step=step, epoch=e, batch=b, rank=r, wall_time=w, values=values)
        for (step, r), (e, b, w, values) in sorted(rows.items())
    ]
    if logged:
        records += store.sparse_records(run.id, logged, rank)
        records.sort(key=lambda rec: (rec.step, rec.sparse))  # stable: each kind keeps its order
    return records


def events_by_kind(events: Sequence[Event]) -> dict[EventKind, int]:
    """How many events of each kind."""
    counts = {kind: 0 for kind in EventKind}
    for e in events:
        counts[e.kind] += 1
    return counts


def short_id(run_id: str) -> str:
    """The first 8 characters of a run id (enough for ``RUN`` as a unique prefix, usually)."""
    return run_id[:8]


def fmt_value(x: float | None) -> str:
    """A metric value as the console prints a plain number (:func:`batchtap._units.number`, the one
    number formatter); ``-`` when there is none.

    Example:
        >>> [fmt_value(x) for x in (0.23456, 134.314, 31420.5, 2.2e-06, float("nan"), None)]
        ['0.2346', '134.3', '3.142e+04', '2.2e-06', 'nan', '-']
    """
    return "-" if x is None else number(x)


def fmt_duration(seconds: float | None) -> str:
    """``12.3s``, ``4m05s``, ``2h13m``; ``-`` when unknown.

    Example:
        >>> fmt_duration(245.2), fmt_duration(7980), fmt_duration(None)
        ('4m05s', '2h13m', '-')
    """
    if seconds is None or math.isnan(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        m, s = divmod(int(round(seconds)), 60)
        return f"{m}m{s:02d}s"
    h, rest = divmod(int(round(seconds)), 3600)
    return f"{h}h{rest // 60:02d}m"


def fmt_time(t: float | None) -> str:
    """A ``time.time()`` value as local ``YYYY-MM-DD HH:MM:SS``; ``-`` when unknown."""
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def fmt_rank(rank: int) -> str:
    """``all`` for the reduced rows, else the rank number."""
    return "all" if rank == ALL_RANKS else str(rank)


def table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] | None = None
) -> Iterator[str]:
    """Lines of a plain text table with columns padded to their widest cell.

    Args:
        header: column titles.
        rows: cells, already formatted.
        right: per column, align right (numbers) instead of left.

    Example:
        >>> print("\\n".join(table(["name", "n"], [["a", "1"], ["bb", "22"]], right=[False, True])))
        name   n
        a      1
        bb    22
    """
    right = list(right) if right is not None else [False] * len(header)
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(parts).rstrip()

    yield line(header)
    for row in rows:
        yield line(row)


def terminal_width() -> int:
    """Columns to fit: the terminal's width (``$COLUMNS`` first), 80 when not a terminal."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def fit_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[bool],
    priority: Sequence[int],
    width: int | None = None,
    shrink: int | None = 0,
) -> Iterator[str]:
    """:func:`table` within ``width`` columns: the columns of the largest ``priority`` number are
    dropped first while the table is too wide; then the column ``shrink`` (default the first, a
    name) is cut with ``~`` down to 12 characters.

    Example:
        >>> rows = [["a-very-long-run-name", "3f2a9c01", "finished", "2026-01-01 10:00"]]
        >>> print("\\n".join(fit_table(["name", "id", "status", "started"], rows, right=[False] * 4,
        ...                              priority=[1, 1, 1, 3], width=36)))
        name              id        status
        a-very-long-run~  3f2a9c01  finished
    """
    width = terminal_width() if width is None else width
    keep = list(range(len(header)))

    def size(cols: Sequence[int]) -> int:
        return sum(max([len(header[i])] + [len(r[i]) for r in rows]) for i in cols) + 2 * (len(cols) - 1)

    while size(keep) > width and len(keep) > 1:
        worst = max(priority[i] for i in keep)
        if worst <= 1:
            break
        keep.remove(max(i for i in keep if priority[i] == worst))
    cells = [[r[i] for i in keep] for r in rows]
    if shrink is not None and shrink in keep and size(keep) > width:
        j = keep.index(shrink)
        over = size(keep) - width
        longest = max([len(header[shrink])] + [len(r[j]) for r in cells])
        limit = max(12, longest - over)
        for r in cells:
            if len(r[j]) > limit:
                r[j] = r[j][: limit - 1] + "~"
    yield from table([header[i] for i in keep], cells, right=[right[i] for i in keep])


def wrap(text: str, *, indent: str = "", width: int | None = None) -> list[str]:
    """``text`` wrapped on words to ``width`` columns, later lines indented by ``indent`` (a word
    longer than a line is cut, never left sticking out).

    Example:
        >>> wrap("step 51 anomaly: loss spike of 3.5e+31 over the median", indent="    ", width=30)
        ['step 51 anomaly: loss spike of', '    3.5e+31 over the median']
    """
    width = terminal_width() if width is None else width
    return textwrap.wrap(text, width=width, subsequent_indent=indent, break_on_hyphens=False, drop_whitespace=True) or [
        ""
    ]


# reST roles and literals as they appear in docstrings reused as help: shown as plain words
_REST_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj|ref):`~?([^`]+)`")
_REST_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str) -> str:
    """``text`` without reST markup (literals, roles), as a terminal shows help.

    Example:
        >>> plain_text("the ``--db`` store, see :mod:`batchtap.store` and :func:`~batchtap.store.open`")
        'the --db store, see batchtap.store and open'
    """
    text = _REST_ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), text)
    return _REST_LITERAL.sub(r"\1", text)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that fits the terminal (80 columns when not one) and shows no reST markup.

    Prose paragraphs are wrapped on words; indented lines (examples) keep their layout, except
    that a line too long puts its ``# comment`` on the next line, and a command still too long is
    wrapped with a deeper indent.
    """

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 28, width: int | None = None):
        super().__init__(prog, indent_increment, max_help_position, width or min(terminal_width(), 100) - 2)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        for para in plain_text(text).split("\n\n"):
            lines = para.splitlines()
            prose = [ln for ln in lines if ln and not ln.startswith(" ")]
            if len(prose) == len([ln for ln in lines if ln]) and not para.rstrip().endswith(":"):
                out.append(
                    textwrap.fill(
                        " ".join(ln.strip() for ln in lines),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,
                    )
                )
                continue
            block: list[str] = []
            # one line too long: every comment of the block goes under its command (aligned alike)
            split = any(len(indent + ln) > width for ln in lines)
            for ln in lines:
                block.extend(self._fit_line(indent + ln, width if split else 10**6, width))
            out.append("\n".join(block))
        return "\n\n".join(out)

    @staticmethod
    def _fit_line(line: str, limit: int, width: int) -> list[str]:
        if len(line) <= limit and "  # " not in line or len(line) <= width and limit > width:
            return [line]
        lead = " " * (len(line) - len(line.lstrip()))
        if not line.strip() or not line.startswith(" "):
            return textwrap.wrap(line, width, subsequent_indent=lead, break_on_hyphens=False) or [line]
        command, sep, comment = line.partition("  # ")
        lines = textwrap.wrap(command.rstrip(), width, subsequent_indent=lead + "    ", break_on_hyphens=False)
        if sep:
            lines += textwrap.wrap(
                "# " + comment.strip(),
                width,
                initial_indent=lead + "    ",
                subsequent_indent=lead + "      ",
                break_on_hyphens=False,
            )
        return lines

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(plain_text(text), width)
