"""``MLflow(tracking_uri, experiment=...)``: each batchtap run as an MLflow run, values in batches."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from batchtap.errors import ConfigError
from batchtap.records import ALL_RANKS, Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks.base import EVENT_COUNTERS, Sink, require

__all__ = ["MLflow"]

# MLflow's own request limits (mlflow.utils.validation): per log_batch call, and value lengths.
_MAX_METRICS_PER_BATCH = 1000
_MAX_PARAMS_PER_BATCH = 100
_MAX_TAGS_PER_BATCH = 100
_MAX_PARAM_VALUE = 6000
_MAX_TAG_VALUE = 8000
_MAX_KEY = 250
# What MLflow accepts in a metric, param or tag key; anything else becomes "_".
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")

_STATUS = {
    RunStatus.FINISHED: "FINISHED",
    RunStatus.FAILED: "FAILED",
    RunStatus.STOPPED: "KILLED",  # MLflow's word for a run ended before its end
    RunStatus.KILLED: "KILLED",
    RunStatus.RUNNING: "RUNNING",
}
#: MLflow tag that holds the batchtap run id (how a resumed or replayed run finds its MLflow run).
RUN_ID_TAG = "batchtap.run_id"


def mlflow_key(name: str) -> str:
    """A metric/param/tag name as MLflow accepts it: characters outside ``[/\\w.\\- :]`` become
    ``_``; at most 250 characters.

    Example:
        >>> mlflow_key("acc@5 (val)")
        'acc_5 _val_'
    """
    return _BAD_KEY_CHARS.sub("_", name)[:_MAX_KEY] or "_"


def _flatten(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Nested config as dotted ``(key, text)`` pairs: ``{"opt": {"lr": 0.1}}`` -> ``("opt.lr", "0.1")``."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, name + ".")
        elif isinstance(value, str):
            yield name, value
        else:
            yield name, json.dumps(value, default=str)


def _chunks(items: list[Any], n: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class MLflow(Sink):
    """Send every batchtap run to MLflow: metrics with ``log_batch``, the run's config as params, its
    end as the MLflow run status.

    * One MLflow run per batchtap run, in ``experiment`` (created when missing), named as the
      batchtap run and tagged ``batchtap.run_id``: a resumed run (``tap.run(resume=...)``) and a
      replay from the spool continue the same MLflow run instead of opening another.
    * Step values go out as metrics at the record's step with its wall time, ``prefix + name``
      (rank ``k >= 1``: ``name/rank<k>``); each written block is one ``log_batch`` request per
      1,000 values. Values logged with ``Tap.log()`` (sparse records) are metrics named as logged,
      at the step they name. NaN (a value that failed validation) is sent as NaN.
    * The config becomes params (nested keys dotted: ``optimizer.lr``; non-strings as JSON), once,
      when the MLflow run is created; the environment (host, versions, git commit) becomes tags.
    * Events are counted per kind as metrics ``batchtap/anomalies``, ``batchtap/actions``,
      ``batchtap/skipped_steps``, ``batchtap/warnings`` (the count so far in this process, at the
      event's step); the messages stay in batchtap's own store.
    * ``end_run`` sets the MLflow status: finished -> ``FINISHED``, failed -> ``FAILED``, stopped
      -> ``KILLED``; tags ``batchtap.status`` and ``batchtap.stop_reason`` keep batchtap's words.
    * Names MLflow refuses are made acceptable by :func:`mlflow_key` (characters outside
      ``[/\\w.\\- :]`` become ``_``).

    It uses its own ``MlflowClient``, never the fluent API's active run, so it does not touch a run
    the training script itself has open with ``mlflow.start_run()``. The constructor does not
    contact the server: the first request is made on the sink thread, at ``start_run``.

    **When the tracking server is down** a request raises; give the Tap a ``spool_dir`` and the
    blocks are spooled to disk and replayed in order when the server answers again (nothing is lost;
    a replayed block logs the same values again, which MLflow's SQL stores keep once: a metric
    value is keyed by name, step, timestamp and value). MLflow itself retries an HTTP request ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` times (default
    7, with backoff, up to minutes); lower it (e.g. ``2``) to fall back on the spool sooner.

    Args:
        tracking_uri: where MLflow stores runs: ``http(s)://server:5000``, ``sqlite:///mlflow.db``,
            ``databricks``...; ``None`` uses MLflow's default (``MLFLOW_TRACKING_URI``).
        experiment: experiment name.
        prefix: put in front of every step metric name (e.g. ``"train/"``); logged values keep
            their own names.
        log_config: send the run's config as params.

    Raises:
        ConfigError: ``experiment`` is empty.
        ImportError: mlflow is not installed (``pip install 'batchtap[mlflow]'``).

    Example:
        >>> import tempfile, os
        >>> from mlflow.tracking import MlflowClient
        >>> uri = "sqlite:///" + os.path.join(tempfile.mkdtemp(), "mlflow.db")
        >>> sink = MLflow(uri, experiment="demo")
        >>> sink.start_run(RunInfo("a1b2", "first", {"lr": 0.1}, started_at=1.0))
        >>> sink.write([Record("a1b2", step=s, epoch=0, batch=s, rank=0, wall_time=2.0 + s,
        ...                    values={"loss": 1.0 / (s + 1)}) for s in range(3)])
        >>> sink.end_run(RunInfo("a1b2", "first", {}, started_at=1.0, status=RunStatus.FINISHED, ended_at=9.0))
        >>> client = MlflowClient(uri)
        >>> run = client.get_run(sink.mlflow_run_id("a1b2"))
        >>> run.info.status, run.data.params
        ('FINISHED', {'lr': '0.1'})
        >>> [(m.step, round(m.value, 3)) for m in client.get_metric_history(run.info.run_id, "loss")]
        [(0, 1.0), (1, 0.5), (2, 0.333)]
    """

    _live = ("_client",)

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str = "batchtap",
        prefix: str = "",
        log_config: bool = True,
    ) -> None:
        if not isinstance(experiment, str) or not experiment.strip():
            raise ConfigError(f"MLflow experiment must be a non-empty name, got {experiment!r}")
        entities = require("mlflow.entities", extra="mlflow", purpose="bt.sinks.MLflow")
        self._Metric: Any = entities.Metric
        self._Param: Any = entities.Param
        self._RunTag: Any = entities.RunTag
        self.tracking_uri = tracking_uri
        self._uri = tracking_uri
        self._client: Any = None
        self._open_live()
        self.experiment = experiment
        self.prefix = prefix
        self.log_config = log_config
        self._experiment_id: str | None = None
        self._runs: dict[str, str] = {}  # batchtap run id -> MLflow run id
        self._counts: dict[tuple[str, EventKind], int] = {}
        self._keys: dict[tuple[str, int, bool], str] = {}

    def _open_live(self) -> None:
        """Make the ``MlflowClient`` (a copy unpickled in another process makes its own; the MLflow
        runs it already knows stay its runs)."""
        tracking = require("mlflow.tracking", extra="mlflow", purpose="bt.sinks.MLflow")
        self._client = tracking.MlflowClient(tracking_uri=self._uri)
        # The store as resolved here: a copy in another process uses the same one even when the
        # default came from this process's mlflow.set_tracking_uri(), which that process lacks.
        self._uri = str(self._client.tracking_uri)

    # -- runs ---------------------------------------------------------------------------------
    def mlflow_run_id(self, run_id: str) -> str | None:
        """The MLflow run id this sink uses for batchtap run ``run_id`` (None before its first request)."""
        return self._runs.get(run_id)

    def _experiment(self) -> str:
        if self._experiment_id is None:
            found = self._client.get_experiment_by_name(self.experiment)
            if found is None:
                try:
                    self._experiment_id = str(self._client.create_experiment(self.experiment))
                except Exception:
                    # Another process may have created it meanwhile; if not, the first error stands.
                    found = self._client.get_experiment_by_name(self.experiment)
                    if found is None:
                        raise
                    self._experiment_id = str(found.experiment_id)
            else:
                self._experiment_id = str(found.experiment_id)
        return self._experiment_id

    def _find(self, run_id: str) -> str | None:
        exp = self._experiment()
        hits = self._client.search_runs([exp], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1)
        return str(hits[0].info.run_id) if hits else None

    def _mlflow_run(self, run: RunInfo | None, run_id: str) -> str:
        """The MLflow run of ``run_id``: cached, else found by tag, else created."""
        known = self._runs.get(run_id)
        if known is not None:
            return known
        found = self._find(run_id)
        if found is None:
            tags = {RUN_ID_TAG: run_id}
            start = None
            if run is not None:
                start = int(run.started_at * 1000)
                tags["batchtap.world_size"] = str(run.world_size)
                for k, v in run.environment.items():
                    if v is not None:
                        tags[mlflow_key(f"batchtap.env.{k}")] = str(v)[:_MAX_TAG_VALUE]
                commit = run.environment.get("git_commit")
                if commit:
                    tags["mlflow.source.git.commit"] = str(commit)
            created = self._client.create_run(
                self._experiment(), start_time=start, tags=tags, run_name=run.name if run is not None else run_id
            )
            found = str(created.info.run_id)
            if run is not None and self.log_config and run.config:
                params = [self._Param(mlflow_key(k), v[:_MAX_PARAM_VALUE]) for k, v in _flatten(run.config)]
                for chunk in _chunks(params, _MAX_PARAMS_PER_BATCH):
                    self._client.log_batch(found, params=chunk)
        self._runs[run_id] = found
        return found

    def start_run(self, run: RunInfo) -> None:
        """Find (resumed, replayed) or create the MLflow run; params from the config. A resumed
        run that MLflow has as ended is marked ``RUNNING`` again."""
        existed = run.id in self._runs or self._find(run.id) is not None
        mid = self._mlflow_run(run, run.id)
        if existed:
            self._client.update_run(mid, status="RUNNING")
        self._client.set_tag(mid, "batchtap.status", run.status.value)

    # -- values -------------------------------------------------------------------------------
    def _key(self, name: str, rank: int, sparse: bool) -> str:
        k = (name, rank, sparse)
        key = self._keys.get(k)
        if key is None:
            base = name if sparse else self.prefix + name
            key = mlflow_key(base if rank in (0, ALL_RANKS) else f"{base}/rank{rank}")
            self._keys[k] = key
        return key

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Send the block's values (and event counts) with ``log_batch``, per run, 1,000 at a time."""
        metric = self._Metric
        by_run: dict[str, list[Any]] = {}
        for r in records:
            ms = by_run.setdefault(r.run_id, [])
            ts = int(r.wall_time * 1000)
            for name, v in r.values.items():
                ms.append(metric(self._key(name, r.rank, r.sparse), float(v), ts, r.step))
        for e in events:
            slot = (e.run_id, e.kind)
            self._counts[slot] = self._counts.get(slot, 0) + 1
            by_run.setdefault(e.run_id, []).append(
                metric(EVENT_COUNTERS[e.kind], float(self._counts[slot]), int(e.wall_time * 1000), e.step)
            )
        for run_id, ms in by_run.items():
            if not run_id:
                continue  # a warning raised before any run started: nothing to attach it to
            mid = self._mlflow_run(None, run_id)
            for chunk in _chunks(ms, _MAX_METRICS_PER_BATCH):
                self._client.log_batch(mid, metrics=chunk)

    def end_run(self, run: RunInfo) -> None:
        """Set the MLflow run's status and end time; tags with batchtap's status and stop reason."""
        mid = self._mlflow_run(run, run.id)
        tags = [self._RunTag("batchtap.status", run.status.value)]
        if run.stop_reason:
            tags.append(self._RunTag("batchtap.stop_reason", run.stop_reason[:_MAX_TAG_VALUE]))
        for chunk in _chunks(tags, _MAX_TAGS_PER_BATCH):
            self._client.log_batch(mid, tags=chunk)
        end = None if run.ended_at is None else int(run.ended_at * 1000)
        self._client.set_terminated(mid, status=_STATUS[run.status], end_time=end)
