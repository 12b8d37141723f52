"""The web application: one page, a JSON API over :class:`~batchtap.ui.data.ReadOnlyStore`, the
live stream, and the chart library's JavaScript served from its installed ``bokeh`` package.

Routes:

* ``/``, ``/run/{id}``, ``/compare?runs=a,b`` — the page (``static/index.html``; ``static/app.js``
  draws the runs table, a run, or a comparison from the path; ``static/early.js`` starts a run
  page's reads before BokehJS has loaded).
* ``/api/runs?q=`` — every run (matching the filter ``q``) with its summary; ``/api/runs/live?q=``
  — the same as server-sent events, then the runs that are new or moved; ``/api/runs/{id}`` — one
  run with its metrics. ``{id}`` is a full id, a unique prefix (the 8-character short id) or a
  name, here and below. The fields are listed in :mod:`batchtap.ui.data`.
* ``/api/runs/{id}/series?metric=&rank=&start=&end=&width=`` — one line, decimated to ``width``.
* ``/api/runs/{id}/events``, ``/api/runs/{id}/ranks?metric=`` — events; the per-rank spread.
* ``/api/runs/{id}/epochs`` — the epochs' step spans (the x axis by epoch).
* ``/api/runs/{id}/live?after=&events=`` — server-sent events while the run is running.
* ``/api/runs/{id}/layers?top=``, ``/api/runs/{id}/histograms?kind=`` — per-layer values grouped by
  layer, and the stored histograms (:mod:`batchtap.ui.layers`; drawn by ``static/layers.js``).
* ``/static/...`` (this package), ``/bokeh/js/...`` (BokehJS from the ``bokeh`` wheel).

Every response carries a Content-Security-Policy that allows scripts, styles and connections from
this server only: even a name that slipped through as HTML could not run or fetch anything.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from batchtap._units import table as units_table
from batchtap.store.runquery import QueryError
from batchtap.ui.auth import LOOPBACK_HOSTS, TokenGate
from batchtap.ui.data import ReadOnlyStore
from batchtap.ui.layers import layer_routes
from batchtap.ui.live import stream_run, stream_runs

__all__ = ["make_app", "CSP"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


class BadRequest(Exception):
    """A query parameter that is missing or malformed."""


# Steps and counts are stored as 64-bit integers; a query number outside this range (1e30, inf)
# could only overflow the database's integer or the stream's arithmetic.
_QUERY_INT_LIMIT = 2**62


def _int(request: Request, name: str) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        try:  # "1e3" or "10.0" from a chart's axis: whole numbers only
            as_float = float(raw)
        except ValueError:
            as_float = math.nan
        if not (math.isfinite(as_float) and as_float.is_integer()):
            raise BadRequest(f"query parameter {name!r} must be an integer, got {raw[:40]!r}") from None
        value = int(as_float)
    if not -_QUERY_INT_LIMIT <= value <= _QUERY_INT_LIMIT:
        raise BadRequest(f"query parameter {name!r} must be an integer between -2**62 and 2**62, got {raw[:40]!r}")
    return value


def _int_or(request: Request, name: str, default: int) -> int:
    value = _int(request, name)
    return default if value is None else value


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers={"cache-control": "no-store"})


def make_app(
    store: ReadOnlyStore,
    *,
    token: str | None = None,
    hosts: frozenset[str] | None = LOOPBACK_HOSTS,
    stopping: Callable[[], bool] = lambda: False,
) -> Any:
    """The ASGI application over an open store.

    Args:
        store: the store, opened read-only.
        token: when set, every request must carry it (``?token=``, the cookie, or a bearer header).
        hosts: the exact Host names answered (:func:`batchtap.ui.auth.allowed_hosts`); ``None``: any
            (only with a token).
        stopping: true once the server shuts down (ends the live streams).

    Raises:
        ConfigError: a token that cannot be used, or ``hosts=None`` without a token.
    """
    page = resources.files("batchtap.ui").joinpath("static", "index.html").read_text(encoding="utf-8")
    # The units table the console uses, as data in the page (a JSON script is not run, so the CSP
    # needs no exception): the charts, tables and tooltips show each metric in the same unit.
    units = json.dumps(units_table(), separators=(",", ":")).replace("<", "\\u003c")
    page = page.replace("<!--units-->", f'<script type="application/json" id="bt-units">{units}</script>')

    def index(request: Request) -> Response:
        return HTMLResponse(page, headers={**_HEADERS, "cache-control": "no-store"})

    def runs(request: Request) -> Response:
        query = request.query_params.get("q") or None
        listed = store.runs(query)
        return _json({"store": store.where, "now": time.time(), "query": query, "runs": listed})

    def runs_live(request: Request) -> Response:
        query = request.query_params.get("q") or None
        if query:
            store.runs(query)  # a bad query is a 400 now, not a broken stream
        body = stream_runs(store, query, stopping)
        return StreamingResponse(body, media_type="text/event-stream", headers={"cache-control": "no-store"})

    def run(request: Request) -> Response:
        found = store.run(request.path_params["run_id"])
        if found is None:
            return _json({"error": f"no run {request.path_params['run_id'][:64]!r} in {store.where}"}, 404)
        return _json(found)

    def run_id(request: Request) -> str:
        """The full id of the run the path names (a short id or name works as in the CLI)."""
        ref = request.path_params["run_id"]
        return store.resolve(ref) or ref

    def series(request: Request) -> Response:
        metric = request.query_params.get("metric")
        if not metric:
            raise BadRequest("query parameter 'metric' is required (a metric name)")
        data = store.series(
            run_id(request),
            metric,
            rank=_int(request, "rank"),
            start=_int(request, "start"),
            end=_int(request, "end"),
            width=_int_or(request, "width", 1000),
        )
        return _json(data)

    def events(request: Request) -> Response:
        return _json({"events": store.events(run_id(request))})

    def epochs(request: Request) -> Response:
        return _json({"epochs": store.epochs(request.path_params["run_id"])})

    def ranks(request: Request) -> Response:
        metric = request.query_params.get("metric") or "step_time"
        return _json(store.rank_spread(run_id(request), metric, width=_int_or(request, "width", 1000)))

    def live(request: Request) -> Response:
        after, seen = _int_or(request, "after", -(2**62)), _int_or(request, "events", 0)
        body = stream_run(store, run_id(request), after, seen, stopping)
        return StreamingResponse(body, media_type="text/event-stream", headers={"cache-control": "no-store"})

    async def bad_request(request: Request, exc: Exception) -> Response:
        return _json({"error": str(exc)}, 400)

    routes = [
        Route("/", index),
        Route("/run/{run_id:str}", index),
        Route("/compare", index),
        Route("/favicon.ico", lambda request: Response(status_code=204)),
        Route("/api/runs", runs),
        Route("/api/runs/live", runs_live),
        Route("/api/runs/{run_id:str}", run),
        Route("/api/runs/{run_id:str}/series", series),
        Route("/api/runs/{run_id:str}/events", events),
        Route("/api/runs/{run_id:str}/ranks", ranks),
        Route("/api/runs/{run_id:str}/epochs", epochs),
        Route("/api/runs/{run_id:str}/live", live),
        *layer_routes(store, run_id, _HEADERS),  # per-layer values and histograms (ui/layers.py)
        Mount("/static", StaticFiles(packages=[("batchtap.ui", "static")]), name="static"),
        # BokehJS as the installed bokeh wheel ships it: nothing vendored here, nothing from a CDN.
        Mount("/bokeh", StaticFiles(packages=[("bokeh", "server/static")]), name="bokeh"),
    ]
    # gzip: JSON series of long runs shrink ~4x (Starlette leaves text/event-stream alone)
    app = Starlette(
        routes=routes,
        exception_handlers={BadRequest: bad_request, QueryError: bad_request},
        middleware=[Middleware(GZipMiddleware, minimum_size=2048)],
    )
    return TokenGate(app, token, hosts)
