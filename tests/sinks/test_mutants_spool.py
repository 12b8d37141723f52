"""The spool (``sinks/spool.py``) when its directory is gone by the time a sink first fails: a slip
a sampled mutation run over issue 38's files let through the resilience and replay tests
(TESTING.md, "third session")."""

from __future__ import annotations

import shutil
from pathlib import Path

from batchtap.records import Record, Write
from batchtap.sinks.spool import Spool


def test_a_spool_whose_directory_was_removed_after_the_check_creates_it_again(tmp_path: Path) -> None:
    """The directory is checked (made) when the sink is built; a cleaner removes it while the run
    goes on; the first block spooled after that still lands, in the directory made again."""
    spool = Spool(tmp_path / "spools" / "sink.spool", "sqlite")
    spool.check_place()
    shutil.rmtree(tmp_path / "spools")
    record = Record("r", step=1, epoch=0, batch=1, rank=0, wall_time=2.5, values={"loss": 0.5})
    spool.append(Write([record], []))
    assert spool.pending
    entries = [entry for _, _, entry in spool.read(lambda message: None)]
    assert [e.records[0].values for e in entries] == [{"loss": 0.5}]
