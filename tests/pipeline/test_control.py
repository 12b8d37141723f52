"""Control on its own: what the pipeline posts, what the training thread takes, the stop state."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from batchtap.pipeline.chain import control as control_module
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


def test_a_judged_input_error_is_held_until_the_next_blocks_hand_over() -> None:
    control = Control()
    assert control.hand_block(7) == 0
    control.judged(7, 0, ValueError("bad step 2"))
    assert not control.has_error  # held: not due before the next hand-over, however soon it came
    assert control.hand_block(7) == 1
    error = control.take_error()
    assert isinstance(error, ValueError) and str(error) == "bad step 2"


def test_a_block_judged_twice_counts_once_and_an_older_chains_report_is_ignored() -> None:
    control = Control()
    control.hand_block(1)
    control.hand_block(2)  # a new run's chain: counted afresh
    control.judged(1, 5, ValueError("an ended run's"))
    control.judged(2, 0)
    control.judged(2, 0)  # resent to a restarted pipeline process
    assert control.hand_block(2) == 1 and not control.has_error
    control.judged(2, 1, ValueError("first"))
    control.judged(2, 1, ValueError("again"))
    control.release_held()  # a drain passed: due at once
    error = control.take_error()
    assert isinstance(error, ValueError) and str(error) == "first"


def test_a_hand_over_waits_for_the_previous_block_to_be_judged() -> None:
    control = Control()
    control.hand_block(3)
    order: list[str] = []

    def judge() -> None:
        order.append("judging")
        control.judged(3, 0, ValueError("late"))

    timer = threading.Timer(0.2, judge)
    timer.start()
    try:
        assert control.hand_block(3) == 1
        order.append("handed")
    finally:
        timer.join()
    assert order == ["judging", "handed"]
    assert isinstance(control.take_error(), ValueError)  # due at this hand-over, not a later one


def test_a_pipeline_failure_ends_the_wait_and_a_paused_gate_never_waits() -> None:
    control = Control()
    control.hand_block(4)
    assert control.hand_block(4, wait=False) == 1  # block 0 not judged: nothing waited for
    threading.Timer(0.2, control.fail, args=(RuntimeError("pipeline died"),)).start()
    assert control.hand_block(4) == 2  # blocks 0 and 1 never judged: the failure ends the wait
    assert str(control.take_error()) == "pipeline died"


def test_a_hand_over_waits_no_longer_than_its_bound_and_the_error_waits_for_a_later_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(control_module, "JUDGE_WAIT", 0.05)  # a stuck pipeline, in short
    control = Control()
    control.hand_block(5)
    assert control.hand_block(5) == 1 and not control.has_error  # block 0 never judged: not a hang
    control.judged(5, 0, ValueError("late"))
    assert not control.has_error
    control.hand_block(5)
    assert str(control.take_error()) == "late"
