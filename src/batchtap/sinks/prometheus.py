"""``Prometheus(port=...)``: the latest values of each run on an HTTP endpoint for Prometheus to scrape."""

from __future__ import annotations

import collections
import socket
from collections.abc import Sequence
from typing import Any

from batchtap.errors import ConfigError, SinkError
from batchtap.records import Event, Record, RunInfo, RunStatus
from batchtap.sinks.base import Sink, require

__all__ = ["Prometheus"]

_STATES = [s.value for s in RunStatus]


class Prometheus(Sink):
    """Serve each run's latest values, event counters and speed at ``http://ADDR:PORT/metrics``.

    Prometheus pulls, so nothing here waits on a server: the sink thread only updates values in
    memory, and prometheus-client's own HTTP thread answers scrapes. A scraper that is away simply
    misses nothing but intermediate values (Prometheus keeps what it scraped; batchtap's store
    keeps every step). Exposed, with labels ``run`` (name) and ``run_id`` on every series:

    ======================================================  ==================================================
    ``batchtap_value{metric, rank}``                        latest step value of each metric (NaN = failed validation)
    ``batchtap_logged_value{metric, rank}``                 latest value logged with ``Tap.log()`` under that name
    ``batchtap_logged_step{metric, rank}``                  the step that logged value refers to
    ``batchtap_step``                                       latest recorded step
    ``batchtap_epoch``                                      its epoch
    ``batchtap_steps_per_second``                           training speed over the last ``rate_window`` seconds
                                                            of step wall times (when the records were captured,
                                                            not when they arrived)
    ``batchtap_events_total{kind, metric}``                 anomalies, actions, skipped steps, warnings (counter)
    ``batchtap_run_status{batchtap_run_status}``            1 for the run's current status (running, finished,
                                                            failed, stopped), 0 for the others
    ``batchtap_run_start_time_seconds``                     when the run started (Unix time)
    ======================================================  ==================================================

    ``rank`` is the process rank, or ``all`` for values reduced over ranks. An ended run's series
    stay (with its final status) until the process exits, so the last scrape sees how it ended.

    The constructor checks that the port is free (and picks one for ``port=0``); the server
    starts at the first ``start_run``/``write``, in the process that runs the sink: under
    ``bt.Tap(pipeline="process")`` the pipeline process serves ``/metrics``, the training
    process's own copy of the sink never listens.

    Args:
        port: TCP port to listen on; ``0`` picks a free one (read it back from :attr:`port`).
        addr: address to bind (prometheus-client's default ``0.0.0.0``: every interface; use
            ``127.0.0.1`` for this machine only).
        rate_window: seconds of recent steps ``batchtap_steps_per_second`` is computed over.

    Raises:
        SinkError: the port cannot be bound (in use, no permission); the message names it. Raised
            by the constructor, or by the first ``start_run``/``write`` when something took the
            port since.
        ConfigError: ``rate_window`` is not positive.
        ImportError: prometheus-client is not installed (``pip install 'batchtap[prometheus]'``).

    Example:
        >>> import urllib.request
        >>> sink = Prometheus(port=0, addr="127.0.0.1")
        >>> sink.start_run(RunInfo("a1b2", "demo", {}, started_at=0.0))
        >>> sink.write([Record("a1b2", step=7, epoch=0, batch=7, rank=0, wall_time=1.0, values={"loss": 0.25})])
        >>> page = urllib.request.urlopen(f"http://127.0.0.1:{sink.port}/metrics").read().decode()
        >>> [line for line in page.splitlines() if line.startswith("batchtap_value")]
        ['batchtap_value{metric="loss",rank="0",run="demo",run_id="a1b2"} 0.25']
        >>> sink.close()
    """

    _live = (
        "registry", "_value", "_logged", "_logged_step", "_step", "_epoch", "_rate", "_events", "_status", "_started",
        "_server", "_thread",
    )  # fmt: skip

    def __init__(self, port: int = 9464, *, addr: str = "0.0.0.0", rate_window: float = 10.0) -> None:
        if not (isinstance(rate_window, (int, float)) and rate_window > 0):
            raise ConfigError(f"Prometheus rate_window must be > 0 seconds, got {rate_window!r}")
        require("prometheus_client", extra="prometheus", purpose="bt.sinks.Prometheus")
        self.rate_window = float(rate_window)
        self.addr = addr
        #: the port served on (the one picked when ``port=0``); checked free here, listened on from
        #: the first ``start_run``/``write`` on.
        self.port: int = _free_port(addr, port)
        self._names: dict[str, str] = {}  # run id -> run name
        self._recent: dict[str, collections.deque[tuple[float, int]]] = {}
        self._open_live()

    def _open_live(self) -> None:
        """The series, in a registry of this process, not served yet (:meth:`_serve`). A copy
        unpickled in another process starts with empty series and serves them from there."""
        prom = require("prometheus_client", extra="prometheus", purpose="bt.sinks.Prometheus")
        # A registry of our own: two sinks (or the user's own metrics) never clash on names.
        self.registry: Any = prom.CollectorRegistry(auto_describe=True)
        run = ["run", "run_id"]
        r = self.registry
        self._value = prom.Gauge(
            "batchtap_value", "Latest step value of each metric", [*run, "metric", "rank"], registry=r
        )
        self._logged = prom.Gauge(
            "batchtap_logged_value",
            "Latest value logged with Tap.log() under each name",
            [*run, "metric", "rank"],
            registry=r,
        )
        self._logged_step = prom.Gauge(
            "batchtap_logged_step", "Step the latest logged value refers to", [*run, "metric", "rank"], registry=r
        )
        self._step = prom.Gauge("batchtap_step", "Latest recorded training step", run, registry=r)
        self._epoch = prom.Gauge("batchtap_epoch", "Epoch of the latest recorded step", run, registry=r)
        self._rate = prom.Gauge(
            "batchtap_steps_per_second",
            "Training steps per second over the recent window of step wall times",
            run,
            registry=r,
        )
        self._events = prom.Counter(
            "batchtap_events",
            "Events: anomalies, actions, skipped steps, warnings",
            [*run, "kind", "metric"],
            registry=r,
        )
        self._status = prom.Enum("batchtap_run_status", "Run status", run, states=_STATES, registry=r)
        self._started = prom.Gauge("batchtap_run_start_time_seconds", "Run start (Unix time)", run, registry=r)
        self._server: Any = None
        self._thread: Any = None

    def _serve(self) -> None:
        """Start the HTTP server on first use, in the process that runs the sink (the pipeline
        process under ``pipeline="process"``, whose series it serves)."""
        if self._server is not None:
            return
        prom = require("prometheus_client", extra="prometheus", purpose="bt.sinks.Prometheus")
        try:
            self._server, self._thread = prom.start_http_server(self.port, addr=self.addr, registry=self.registry)
        except OSError as exc:
            raise _cannot_listen(self.addr, self.port, exc) from exc

    def _labels(self, run_id: str) -> tuple[str, str]:
        return self._names.get(run_id, run_id), run_id

    def start_run(self, run: RunInfo) -> None:
        """Publish the run as running."""
        self._serve()
        self._names[run.id] = run.name
        self._recent[run.id] = collections.deque()
        labels = self._labels(run.id)
        self._status.labels(*labels).state(run.status.value)
        self._started.labels(*labels).set(run.started_at)

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Set the gauges to the block's latest values and count its events."""
        self._serve()
        for rec in records:
            labels = self._labels(rec.run_id)
            rank = "all" if rec.rank < 0 else str(rec.rank)
            if rec.sparse:
                for name, v in rec.values.items():
                    self._logged.labels(*labels, name, rank).set(v)
                    self._logged_step.labels(*labels, name, rank).set(rec.step)
                continue
            for name, v in rec.values.items():
                self._value.labels(*labels, name, rank).set(v)
            self._step.labels(*labels).set(rec.step)
            self._epoch.labels(*labels).set(rec.epoch)
            self._note_speed(rec)
        for e in events:
            self._events.labels(*self._labels(e.run_id), e.kind.value, e.metric or "").inc()

    def _note_speed(self, rec: Record) -> None:
        recent = self._recent.setdefault(rec.run_id, collections.deque())
        if recent and rec.step <= recent[-1][1]:
            return  # another rank's row of a step already counted
        recent.append((rec.wall_time, rec.step))
        while len(recent) > 2 and recent[-1][0] - recent[1][0] >= self.rate_window:
            recent.popleft()
        (t0, s0), (t1, s1) = recent[0], recent[-1]
        if t1 > t0:
            self._rate.labels(*self._labels(rec.run_id)).set((s1 - s0) / (t1 - t0))

    def end_run(self, run: RunInfo) -> None:
        """Publish the run's final status."""
        self._serve()
        self._names.setdefault(run.id, run.name)
        self._status.labels(*self._labels(run.id)).state(run.status.value)
        self._recent.pop(run.id, None)

    def close(self) -> None:
        """Stop serving and free the port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None

    @property
    def url(self) -> str:
        """The scrape URL."""
        host = "127.0.0.1" if self.addr in ("0.0.0.0", "") else self.addr
        return f"http://{host}:{self.port}/metrics"


def _cannot_listen(addr: str, port: int, exc: OSError) -> SinkError:
    return SinkError(
        f"bt.sinks.Prometheus cannot listen on {addr}:{port}: {exc.strerror or exc}; expected a free "
        "port; fix: pass another port= (0 picks a free one) or stop what holds it"
    )


def _free_port(addr: str, port: int) -> int:
    """``port`` once checked free at ``addr`` (for ``0``: a free port picked now), so that a port in
    use fails at construction; the server itself binds it later, in the process that serves."""
    try:
        family, _, _, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket
            probe.bind(where)
            return int(probe.getsockname()[1])
    except OSError as exc:
        raise _cannot_listen(addr, port, exc) from exc
