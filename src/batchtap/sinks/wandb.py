"""``WandB(project=..., mode=...)``: each batchtap run as a Weights & Biases run."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

from batchtap.errors import ConfigError, SinkError
from batchtap.records import ALL_RANKS, Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks.base import EVENT_COUNTERS, Sink, require

__all__ = ["WandB", "STEP_KEY"]

#: The x-axis every value is plotted against: the batchtap step (W&B's own ``_step`` only counts rows).
STEP_KEY = "batchtap/step"
_EPOCH_KEY = "batchtap/epoch"
Mode = Literal["online", "offline", "disabled"]


class WandB(Sink):
    """Send every batchtap run to W&B as a run of its own, through the ``wandb`` package.

    * ``wandb.init`` runs on the sink thread at ``start_run`` (never on the training thread) with
      the batchtap run's id as the W&B run id (``resume="allow"``: a resumed batchtap run, or a
      replay after an outage, continues the same W&B run), its name, and its config.
    * Every record is one history row: its values (step values as ``prefix + name``, rank
      ``k >= 1`` as ``name/rank<k>``; values logged with ``Tap.log()`` by their own names), plus
      ``batchtap/step``, ``batchtap/epoch`` and ``_timestamp`` (the step's own wall time). Every
      metric is plotted against ``batchtap/step`` (``define_metric("*", step_metric=...)``), so a
      value logged for an earlier step lands at that step instead of being dropped as W&B does with
      a ``step=`` that goes back.
    * Events are counted per kind as ``batchtap/anomalies``, ``batchtap/actions``,
      ``batchtap/skipped_steps``, ``batchtap/warnings`` (the count so far, at the event's step).
    * ``end_run`` writes ``batchtap/status`` and ``batchtap/stop_reason`` to the summary and
      finishes the W&B run, with exit code 0 when the run finished and 1 otherwise (W&B shows
      ``failed``).

    **When W&B is down.** Uploads are W&B's own business: the ``wandb`` service writes everything
    to the run's local ``.wandb`` file and retries the network itself (offline mode never uses it;
    ``wandb sync`` uploads later). When the local ``wandb`` service itself fails (it died, or
    ``wandb.init`` could not reach the server), the sink raises :class:`SinkError`; give the Tap a
    ``spool_dir`` and the block is spooled and replayed: the next attempt restarts the service and
    resumes the same W&B run (in offline mode the resumed part is a second ``offline-run-*``
    folder with the same run id). The service writes its file only every 15 s, so rows it had
    taken but not yet written die with it: the sink keeps the rows of the last ``resend_window``
    seconds and logs them again after a restart. Delivery is at least once: rows the service had
    written, or half of a failed block, may then appear twice (same ``batchtap/step``).

    The sink never touches ``wandb.run`` (the script's own W&B run, if any): it keeps its own run
    objects (``reinit="create_new"``), and it does not capture the console.

    Args:
        project: W&B project.
        entity: W&B team or user (default: the logged-in user's default entity).
        mode: ``"online"``, ``"offline"`` (write locally, upload with ``wandb sync``) or
            ``"disabled"``.
        dir: where W&B writes its ``wandb/`` folder (default: W&B's, the working directory).
        prefix: put in front of every step metric name; logged values keep their own names.
        tags: W&B tags for every run.
        group: W&B group for every run (e.g. the ranks or the sweep of one experiment).
        resend_window: seconds of rows kept to log again after the wandb service failed (it
            writes its file every 15 s by default, ``x_transaction_log_flush_interval``).

    Raises:
        ConfigError: ``project`` is empty or ``mode`` unknown.
        ImportError: wandb is not installed (``pip install 'batchtap[wandb]'``).

    Example:
        >>> import tempfile
        >>> sink = WandB(project="demo", mode="offline", dir=tempfile.mkdtemp())
        >>> sink.start_run(RunInfo("a1b2c3", "first", {"lr": 0.1}, started_at=0.0))
        >>> sink.write([Record("a1b2c3", step=0, epoch=0, batch=0, rank=0, wall_time=1.0, values={"loss": 0.7})])
        >>> sink.end_run(RunInfo("a1b2c3", "first", {}, started_at=0.0, status=RunStatus.FINISHED))
        >>> os.path.basename(sink.files["a1b2c3"][0])
        'run-a1b2c3.wandb'
    """

    _live = ("_wandb", "_runs", "_sent")

    def __init__(
        self,
        project: str,
        *,
        entity: str | None = None,
        mode: Mode = "online",
        dir: str | os.PathLike[str] | None = None,  # noqa: A002 - wandb.init's own name
        prefix: str = "train/",
        tags: Sequence[str] = (),
        group: str | None = None,
        resend_window: float = 30.0,
    ) -> None:
        if not isinstance(project, str) or not project.strip():
            raise ConfigError(f"WandB project must be a non-empty name, got {project!r}")
        if mode not in ("online", "offline", "disabled"):
            raise ConfigError(f"WandB mode must be 'online', 'offline' or 'disabled', got {mode!r}")
        if not (isinstance(resend_window, (int, float)) and resend_window >= 0):
            raise ConfigError(f"WandB resend_window must be >= 0 seconds, got {resend_window!r}")
        require("wandb", extra="wandb", purpose="bt.sinks.WandB")
        self.project = project
        self.entity = entity
        self.mode: Mode = mode
        self.dir = None if dir is None else os.fspath(dir)
        self.prefix = prefix
        self.tags = list(tags)
        self.group = group
        self._infos: dict[str, RunInfo] = {}  # to (re)open a run after an outage
        self._counts: dict[tuple[str, EventKind], int] = {}
        self._keys: dict[tuple[str, int, bool], str] = {}
        self.resend_window = float(resend_window)
        self._resend: list[tuple[float, str, dict[str, Any]]] = []
        #: rows logged again after a restart of the wandb service.
        self.resent = 0
        #: batchtap run id -> the local ``.wandb`` files W&B wrote for it (one per (re)start).
        self.files: dict[str, list[str]] = {}
        self._open_live()

    def _open_live(self) -> None:
        """No W&B run open yet (a copy unpickled in another process opens its own, resuming the W&B
        runs the original had open, as after an outage)."""
        self._wandb: Any = require("wandb", extra="wandb", purpose="bt.sinks.WandB")
        self._runs: dict[str, Any] = {}  # batchtap run id -> open wandb Run
        # (monotonic time sent, run id, row): rows this process's service may not have written yet
        self._sent: collections.deque[tuple[float, str, dict[str, Any]]] = collections.deque()

    # -- runs ---------------------------------------------------------------------------------
    def _open(self, run_id: str) -> Any:
        run = self._runs.get(run_id)
        if run is not None:
            return run
        info = self._infos.get(run_id)
        wandb = self._wandb
        try:
            run = wandb.init(
                project=self.project,
                entity=self.entity,
                mode=self.mode,
                dir=self.dir,
                id=run_id,
                name=info.name if info is not None else None,
                config=dict(info.config) if info is not None else None,
                tags=self.tags or None,
                group=self.group,
                resume="allow",
                reinit="create_new",
                settings=wandb.Settings(silent=True, console="off"),
            )
        except Exception as exc:
            self._restart_service()
            raise SinkError(f"bt.sinks.WandB: wandb.init failed for run {run_id}: {type(exc).__name__}: {exc}") from exc
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY)
        sync_file = getattr(run.settings, "sync_file", None)
        if sync_file:
            self.files.setdefault(run_id, []).append(os.path.abspath(sync_file))
        self._runs[run_id] = run
        again = [x for x in self._resend if x[1] == run_id]
        if again:
            for _, _, row in again:
                self._call(run_id, "log", run.log, row)
            self._resend = [x for x in self._resend if x[1] != run_id]
            self.resent += len(again)
        return run

    def _restart_service(self) -> None:
        """After the local wandb service failed: drop every run object and the dead connection, so
        the next attempt starts a fresh service (``wandb.teardown`` resets it even when it raises).
        The rows of the last ``resend_window`` seconds are sent again once the run is reopened."""
        self._runs.clear()
        self._resend.extend(self._sent)
        self._sent.clear()
        try:
            self._wandb.teardown()
        except Exception:  # noqa: BLE001 - the connection is already gone; teardown still resets it
            pass

    def _call(self, run_id: str, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            self._restart_service()
            raise SinkError(f"bt.sinks.WandB: {what} failed for run {run_id}: {type(exc).__name__}: {exc}") from exc

    def start_run(self, run: RunInfo) -> None:
        """Open (or resume) the W&B run: id, name and config from the batchtap run."""
        self._infos[run.id] = run
        self._open(run.id)

    # -- values -------------------------------------------------------------------------------
    def _key(self, name: str, rank: int, sparse: bool) -> str:
        k = (name, rank, sparse)
        key = self._keys.get(k)
        if key is None:
            base = name if sparse else self.prefix + name
            key = base if rank in (0, ALL_RANKS) else f"{base}/rank{rank}"
            self._keys[k] = key
        return key

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        """Log one history row per record, and the block's event counts."""
        rows: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            row: dict[str, Any] = {self._key(n, r.rank, r.sparse): float(v) for n, v in r.values.items()}
            row[STEP_KEY] = r.step
            row[_EPOCH_KEY] = r.epoch
            row["_timestamp"] = r.wall_time
            rows.setdefault(r.run_id, []).append(row)
        for e in events:
            if not e.run_id:
                continue  # a warning raised before any run started: nothing to attach it to
            slot = (e.run_id, e.kind)
            self._counts[slot] = self._counts.get(slot, 0) + 1
            rows.setdefault(e.run_id, []).append(
                {EVENT_COUNTERS[e.kind]: self._counts[slot], STEP_KEY: e.step, "_timestamp": e.wall_time}
            )
        now = time.monotonic()
        while self._sent and self._sent[0][0] < now - self.resend_window:
            self._sent.popleft()
        for run_id, batch in rows.items():
            run = self._open(run_id)
            for row in batch:
                self._call(run_id, "log", run.log, row)
                self._sent.append((now, run_id, row))

    def end_run(self, run: RunInfo) -> None:
        """Summary ``batchtap/status`` (and ``batchtap/stop_reason``), then finish the W&B run."""
        self._infos[run.id] = run
        wb = self._open(run.id)
        summary = {"batchtap/status": run.status.value}
        if run.stop_reason:
            summary["batchtap/stop_reason"] = run.stop_reason
        self._call(run.id, "summary", wb.summary.update, summary)
        self._call(run.id, "finish", wb.finish, exit_code=0 if run.status is RunStatus.FINISHED else 1)
        self._runs.pop(run.id, None)
        # finish() returned: the service wrote the run's file; nothing of it needs sending again
        self._sent = collections.deque(x for x in self._sent if x[1] != run.id)

    def close(self) -> None:
        """Finish W&B runs left open (a run whose end never came counts as failed)."""
        for run_id, run in list(self._runs.items()):
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001 - closing: nothing more can be done for it
                pass
            self._runs.pop(run_id, None)
