"""Mutation survivors of an independent run (issue 38), each a wrong value no test noticed: GpuStarved
at exactly its thresholds, and the shared-memory sweep taking a live orphan's segment. (System's
averaging and short steps: tests/metrics/test_system.py; the webhook's 5xx retry:
tests/sinks/test_webhook.py.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from batchtap.records import Record
from batchtap.rules import GpuStarved, History


def _fired(rule: GpuStarved, values: dict[str, float]) -> bool:
    record = Record("r", 100, 0, 100, 0, 0.0, values)
    fired = rule.check(record, History()) is not None
    rule.update(record, fired=fired)
    return fired


@pytest.mark.parametrize(
    ("util", "data", "step", "fires"),
    [
        pytest.param(50.0, 0.5, 0.5, False, id="util-exactly-at-threshold-is-not-below"),
        pytest.param(49.999, 0.5, 0.5, True, id="util-just-below"),
        pytest.param(10.0, 0.3, 0.7, True, id="share-exactly-at-threshold-counts"),
        pytest.param(10.0, 0.843 * 0.3, 0.843 * 0.7, True, id="share-at-threshold-rounded-one-ulp-under"),
        pytest.param(10.0, 0.2999, 0.7001, False, id="share-just-under"),
    ],
)
def test_gpu_starved_at_exactly_its_thresholds(util: float, data: float, step: float, fires: bool) -> None:
    rule = GpuStarved(util_below=50.0, data_share=0.3, patience=1, warmup=0)
    assert _fired(rule, {"gpu0_util": util, "data_time": data, "step_time": step}) is fires


def test_gpu_starved_patience_counts_exactly() -> None:
    rule = GpuStarved(patience=3, warmup=0)
    starved = {"gpu0_util": 10.0, "data_time": 0.5, "step_time": 0.5}
    assert [_fired(rule, starved) for _ in range(7)] == [False, False, True, False, False, True, False]


def test_the_shm_sweep_leaves_a_live_orphans_segment_and_takes_an_abandoned_one() -> None:
    """The owner died, its pipeline process lives on in the owner's process group (an orphan that
    may still have to attach): its segment stays; a segment whose group is empty goes."""
    import secrets
    import subprocess
    import sys
    from multiprocessing import shared_memory

    from batchtap import _stale

    if not _stale.SHM_DIR.is_dir():
        pytest.skip(f"no {_stale.SHM_DIR} here")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, start_new_session=True
    )
    token = secrets.token_hex(3)
    live_name = f"bt{dead.pid}_{orphan.pid}_1_{token}a"  # group = the orphan's session: alive
    gone_name = f"bt{dead.pid}_{dead.pid}_1_{token}b"  # group of the dead owner alone: empty
    made = []
    try:
        for name in (live_name, gone_name):
            made.append(shared_memory.SharedMemory(name=name, create=True, size=64))
            _stale.untrack(name)
        removed = _stale.sweep_segments(where=_stale.SHM_DIR)
        assert live_name not in removed
        assert (_stale.SHM_DIR / live_name).exists()  # the live orphan keeps its segment
        assert not (_stale.SHM_DIR / gone_name).exists()  # (another batchtap process may have swept it first)
        assert orphan.stdin is not None
        orphan.stdin.close()
        # the orphan exits but is not reaped yet: its group holds a zombie only, which uses nothing
        stat = Path(f"/proc/{orphan.pid}/stat")
        deadline = time.monotonic() + 60
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the orphan did not exit"
            time.sleep(0.01)
        _stale.sweep_segments(where=_stale.SHM_DIR)
        assert not (_stale.SHM_DIR / live_name).exists()  # now abandoned: swept
        orphan.wait(30)
    finally:
        if orphan.poll() is None:
            orphan.kill()
        for segment in made:
            segment.close()
            _stale.unlink_segment(segment.name)
