"""Control on its own: what the pipeline posts, what the training thread takes, the stop state."""

from __future__ import annotations

from collections import Counter

from batchtap.pipeline.chain.control import Control, Verdict


def test_verdicts_are_taken_oldest_first_and_counted() -> None:
    control = Control()
    first, second = Verdict([], 1), Verdict([], 2)
    control.post(first)
    control.post(second)
    assert (control.received, control.waiting, control.applied) == (2, 2, 0)
    assert list(control.take_verdicts(1)) == [first]
    assert (control.received, control.waiting, control.applied) == (2, 1, 1)
    assert list(control.take_verdicts(1)) == [second]


def test_the_first_error_is_kept_and_taken_once() -> None:
    control = Control()
    control.fail(ValueError("first"))
    control.fail(ValueError("second"))
    assert control.has_error
    error = control.take_error()
    assert isinstance(error, ValueError) and str(error) == "first"
    assert control.take_error() is None and not control.has_error


def test_the_first_stop_request_wins_and_an_agreed_stop_is_kept() -> None:
    control = Control()
    assert control.request_stop("nan", 4)
    assert not control.request_stop("later", 9)
    assert control.local_stop == ("nan", 4) and control.stop_reason is None
    control.agree_stop("nan")
    control.agree_stop("another")
    assert control.stop_reason == "nan"


def test_anomaly_counts_are_a_snapshot_not_the_pipelines_counter() -> None:
    control = Control()
    counts = Counter({"loss": 1})
    control.count_anomalies(counts)
    counts["loss"] += 5  # the pipeline goes on counting in its own
    assert control.anomaly_counts == {"loss": 1}


def test_reset_forgets_the_last_run() -> None:
    control = Control()
    control.post(Verdict([], 0))
    control.request_stop("x", 1)
    control.agree_stop("x")
    control.fail(RuntimeError("x"))
    control.count_anomalies({"loss": 2})
    control.reset()
    assert (control.waiting, control.applied, control.local_stop, control.stop_reason) == (0, 0, None, None)
    assert not control.has_error and control.anomaly_counts == {}
