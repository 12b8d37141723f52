"""The webhook's cooldown and its per-run names (``sinks/webhook.py``) against a real local HTTP
server: slips a sampled mutation run over issue 38's files let through ``test_webhook.py``
(TESTING.md, "third session")."""

from __future__ import annotations

from batchtap.records import Event, EventKind, RunInfo, RunStatus
from batchtap.sinks import Webhook
from tests.sinks.test_webhook import Scripted


def _anomaly(step: int) -> Event:
    return Event("r1", step, EventKind.ANOMALY, "loss=nan", 0.0, "loss", float("nan"))


def test_events_inside_the_cooldown_are_dropped_not_posted() -> None:
    """A failed post starts the cooldown: a later event's post is not even tried (counted dropped);
    only the run's end alert is tried inside it."""
    ep = Scripted([(500, None)])
    try:
        hook = Webhook(ep.base + "/hook", events=("anomaly", "finished"), retries=0, cooldown=3600)
        hook.start_run(RunInfo("r1", "hooked", {}, 0.0))
        hook.write([], [_anomaly(3)])
        assert len(ep.seen) == 1 and hook.dropped == 1
        hook.write([], [_anomaly(7)])  # the endpoint would take it now (200): the cooldown holds it back
        assert len(ep.seen) == 1 and hook.dropped == 2 and hook.delivered == 0
        hook.end_run(RunInfo("r1", "hooked", {}, 0.0, status=RunStatus.FINISHED))
    finally:
        ep.close()
    assert len(ep.seen) == 2 and hook.delivered == 1


def test_a_runs_name_is_forgotten_at_its_end() -> None:
    """A long-lived process making run after run (a sweep) keeps no name per ended run."""
    ep = Scripted([])
    try:
        hook = Webhook(ep.base + "/hook", events=("finished",), retries=0)
        for i in range(3):
            hook.start_run(RunInfo(f"r{i}", f"trial-{i}", {}, 0.0))
            hook.end_run(RunInfo(f"r{i}", f"trial-{i}", {}, 0.0, status=RunStatus.FINISHED))
    finally:
        ep.close()
    assert hook.delivered == 3 and hook._names == {}
