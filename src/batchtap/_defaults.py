"""Defaults shared by the Tap and the CLI (no torch import here: the CLI starts without torch)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchtap.errors import ConfigError

if TYPE_CHECKING:
    from batchtap.sinks.base import Sink

__all__ = [
    "DEFAULT_DB",
    "check_int",
    "checked_metrics",
    "checked_numbers",
    "checked_sinks",
    "default_sinks",
    "store_url",
]

#: where runs are stored when nothing else is said: SQLite, relative to the working directory
DEFAULT_DB = os.path.join("runs", "batchtap.db")


def store_url() -> str:
    """The store a Tap without ``sinks=`` writes to and the CLI reads: ``$BATCHTAP_DB``, else
    :data:`DEFAULT_DB`."""
    return os.environ.get("BATCHTAP_DB") or DEFAULT_DB


def _sink_for(value: object) -> str | None:
    """The sink a user most likely meant by a path or URL given where a sink was expected."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        return None
    if value.startswith(("postgresql://", "postgres://")):
        return "bt.sinks.Postgres(URL)"
    suffix = Path(value).suffix.lower()
    if suffix == ".jsonl":
        return f"bt.sinks.JSONL({value!r})"
    if suffix == ".csv":
        return f"bt.sinks.CSV({value!r})"
    return f"bt.sinks.SQLite({value!r})"


def checked_sinks(
    sinks: Sequence[Sink] | Sink | str, spool_dir: str | os.PathLike[str] | None, *, rank: int
) -> list[Sink]:
    """The Tap's sinks, each wrapped in a spooling ResilientSink when ``spool_dir`` is given —
    except sinks that show what happens now (``Sink.wrap_in_spool`` False: the console), which are
    never spooled nor replayed.

    Raises:
        ConfigError: ``sinks`` is not a list of :class:`~batchtap.sinks.Sink` objects; a path or
            URL names the sink that stores there.
    """
    from batchtap.sinks.base import Sink

    if isinstance(sinks, Sink):
        raise ConfigError(
            f"sinks must be a list of sinks, got a single {type(sinks).__name__}; fix: sinks=[{type(sinks).__name__}(...)]"
        )
    if isinstance(sinks, (str, os.PathLike)):
        raise ConfigError(
            f"sinks must be a list of sinks, got the path {os.fspath(sinks)!r}; fix: sinks=[{_sink_for(sinks)}]"
        )
    try:
        given = list(sinks)
    except TypeError:
        raise ConfigError(
            f"sinks must be a list of batchtap.sinks.Sink objects, got {type(sinks).__name__}; "
            "fix: e.g. sinks=[bt.sinks.SQLite('runs/x.db'), bt.sinks.Console()]"
        ) from None
    for i, sink in enumerate(given):
        if isinstance(sink, Sink):
            continue
        meant = _sink_for(sink)
        if meant is not None:
            raise ConfigError(
                f"sinks[{i}] must be a batchtap.sinks.Sink, got the path {os.fspath(sink)!r}; fix: {meant}"  # type: ignore[arg-type]
            )
        raise ConfigError(
            f"sinks[{i}] must be a batchtap.sinks.Sink object, got {type(sink).__name__}; fix: a built-in sink "
            "(bt.sinks.SQLite, JSONL, CSV, Console, ...) or subclass batchtap.sinks.Sink and implement "
            "write(records, events)"
        )
    if spool_dir is None:
        return given
    from batchtap.sinks.resilient import ResilientSink

    return [
        ResilientSink(sink, spool_path=Path(spool_dir) / f"{i:02d}-{type(sink).__name__.lower()}.rank{rank}.jsonl")
        if sink.wrap_in_spool
        else sink
        for i, sink in enumerate(given)
    ]


def checked_metrics(metrics: object) -> list[Any]:
    """The Tap's ``metrics=`` as a list, refusing a single metric or anything but metrics with an
    error naming the fix (imports the metrics, and so torch, only when called).

    Raises:
        ConfigError: ``metrics`` is one metric, or not a list of metrics.
    """
    from batchtap.metrics.base import Metric

    if isinstance(metrics, Metric):
        name = type(metrics).__name__
        raise ConfigError(
            f"metrics must be a list of metrics, got a single {name}; fix: metrics=[bt.metrics.{name}(...)]"
        )
    if isinstance(metrics, (str, bytes)) or not isinstance(metrics, Iterable):
        raise ConfigError(
            f"metrics must be a list of batchtap.metrics.Metric objects, got {type(metrics).__name__}; "
            "fix: e.g. metrics=[bt.metrics.Loss(), bt.metrics.Accuracy()]"
        )
    given = list(metrics)
    for i, metric in enumerate(given):
        if not isinstance(metric, Metric):
            hint = " (a class: call it)" if isinstance(metric, type) and issubclass(metric, Metric) else ""
            raise ConfigError(
                f"metrics[{i}] must be a batchtap.metrics.Metric object, got {metric!r}{hint}; fix: e.g. "
                "bt.metrics.Loss(), or bt.metrics.Custom(name, fn) for a value of your own"
            )
    return given


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


def checked_numbers(
    flush_every: object,
    flush_seconds: object,
    sample_every: object,
    queue_size: object,
    capacity: object,
    collective_timeout: object,
    end_timeout: object,
) -> int:
    """The Tap's numeric settings checked (a clear error for each); returns the ring's capacity
    (default: 4 flushes' rows)."""
    check_int("flush_every", flush_every, 1)
    check_int("sample_every", sample_every, 1)
    check_int("queue_size", queue_size, 1)
    if not (isinstance(flush_seconds, (int, float)) and flush_seconds > 0):
        raise ConfigError(f"flush_seconds must be > 0, got {flush_seconds!r}")
    assert isinstance(flush_every, int)
    capacity = 4 * flush_every if capacity is None else capacity
    check_int("capacity", capacity, 1)
    assert isinstance(capacity, int)
    if capacity < 2 * flush_every:
        raise ConfigError(
            f"capacity must be >= 2 * flush_every = {2 * flush_every} so rows are never overwritten "
            f"before their copy ran, got {capacity}; raise capacity or lower flush_every"
        )
    for label, seconds in (("collective_timeout", collective_timeout), ("end_timeout", end_timeout)):
        if not (isinstance(seconds, (int, float)) and 0 < seconds < math.inf):
            raise ConfigError(f"{label} must be a finite number of seconds > 0, got {seconds!r}")
    return capacity


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
