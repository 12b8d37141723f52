"""Live updates as server-sent events: a running run's new points, events and status, pushed.

One stream per open run page. Every ``interval`` seconds it reads, per line shown, the points past
the last step it sent (a key-range probe of the store: cheap while nothing is new), the event count
and the run's status, and sends what changed as one ``update`` message. A block of records is
committed whole, so a point seen is a complete step. When the run has ended the stream sends the
last points and an ``end`` message and closes (the page then closes its ``EventSource``, which would
otherwise reconnect).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio.to_thread

from batchtap.ui.data import ReadOnlyStore

__all__ = ["stream_run", "stream_runs", "sse"]

#: Seconds between two reads of the store (what bounds the delay from a flush to the page).
INTERVAL = 0.2
#: Points of one line sent per poll at most: a page that opens its stream far behind catches up
#: over a few polls instead of one response holding the whole run (50 such streams at once held
#: ~1.2 GB of Python objects on a 96 MB store). 2,000 points per 0.2 s poll is 10,000 steps a
#: second per line, far more than a run writes; what one poll holds is bounded by it (~100 B a
#: point: 50 streams x 7 lines x 2,000 points ~70 MB at worst).
CATCH_UP = 2_000
#: A comment line this often keeps proxies from closing an idle stream.
KEEPALIVE = 15.0
#: Seconds between two reads of the runs table by the live runs table (a read of every run's row
#: and step figures: heavier than one run's key probes).
RUNS_INTERVAL = 1.0


def sse(event: str, data: Any) -> bytes:
    """One server-sent event (``data`` as one line of JSON).

    Example:
        >>> sse("end", {"status": "finished"})
        b'event: end\\ndata: {"status": "finished"}\\n\\n'
    """
    return f"event: {event}\ndata: {json.dumps(data, allow_nan=False)}\n\n".encode()


async def stream_run(
    store: ReadOnlyStore,
    run_id: str,
    after: int,
    events_seen: int,
    stopping: Callable[[], bool],
    interval: float = INTERVAL,
) -> AsyncIterator[bytes]:
    """Server-sent events for one run: ``update`` messages, then ``end`` once the run ended.

    Args:
        store: the store.
        run_id: the run.
        after: the last step the page has; points after it are sent.
        events_seen: how many events the page has; the whole list is sent again when it grows.
        stopping: true once the server shuts down (the stream then ends at once, so shutting
            down never waits on an open page).
        interval: seconds between reads.
    """
    last: dict[str, int] = {}
    status: str | None = None
    idle = 0.0
    yield b"retry: 1000\n\n"
    while not stopping():
        update, status, events_seen = await anyio.to_thread.run_sync(
            _read, store, run_id, after, last, status, events_seen
        )
        if len(update) > 1:
            idle = 0.0
            yield sse("update", update)
        if status != "running":
            yield sse("end", {"status": status})
            return
        await asyncio.sleep(interval)
        idle += interval
        if idle >= KEEPALIVE:
            idle = 0.0
            yield b": keepalive\n\n"


def _read(
    store: ReadOnlyStore, run_id: str, after: int, last: dict[str, int], status: str | None, events_seen: int
) -> tuple[dict[str, Any], str | None, int]:
    """One poll: what changed since the last one (read the status first, so that a run seen as
    ended has every point it will ever have read after it)."""
    update: dict[str, Any] = {"run": run_id}
    now = store.status(run_id)
    new_status = None if now is None else now[0]
    if new_status != status:
        update["status"] = new_status
        update["ended_at"] = None if now is None else now[1]
        update["stop_reason"] = None if now is None else now[2]
    lines: dict[str, Any] = {}
    for metric in store.metric_names(run_id):
        rank = store.ranks(run_id, metric)[:1]
        if not rank:
            continue
        got = store.after(run_id, metric, rank[0], last.get(metric, after), limit=CATCH_UP)
        if got["step"]:
            last[metric] = got["step"][-1]
            lines[metric] = got
    if lines:
        update["lines"] = lines
    count = store.event_count(run_id)
    if count != events_seen:
        update["events"] = store.events(run_id)
        events_seen = count
    return update, new_status, events_seen


async def stream_runs(
    store: ReadOnlyStore,
    query: str | None,
    stopping: Callable[[], bool],
    interval: float = RUNS_INTERVAL,
) -> AsyncIterator[bytes]:
    """Server-sent ``runs`` messages for the runs table: every matching run first, then the runs
    that are new or moved (status, steps, end; running runs each time, their duration grows) and
    the ids of runs gone, as often as ``interval`` while anything changes.

    Args:
        store: the store.
        query: the runs filter (already checked to parse by the caller), or ``None``.
        stopping: true once the server shuts down.
        interval: seconds between reads.
    """
    seen: dict[str, tuple[Any, ...]] = {}
    idle = 0.0
    yield b"retry: 1000\n\n"
    while not stopping():
        update = await anyio.to_thread.run_sync(_runs_update, store, query, seen)
        if update["runs"] or update["removed"] or update["first"]:
            idle = 0.0
            yield sse("runs", update)
        await asyncio.sleep(interval)
        idle += interval
        if idle >= KEEPALIVE:
            idle = 0.0
            yield b": keepalive\n\n"


def _runs_update(store: ReadOnlyStore, query: str | None, seen: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    import time

    from batchtap.store import runquery

    first = not seen
    moved, gone = store.changes(seen)
    rows = [store.summary(r) for r in sorted(moved, key=lambda r: (-r.started_at, r.id))]
    if query:
        # a run that moved out of the filter (its status changed) leaves the table
        kept = runquery.parse(query).matching(rows)
        gone += [r["id"] for r in rows if r not in kept]
        rows = kept
    return {"first": first, "now": time.time(), "runs": rows, "removed": gone}
