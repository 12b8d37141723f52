"""``owner_gone`` (``_stale.py``) on environments without a usable pid: a slip a sampled mutation
run over issue 38's files let through the fault tests (TESTING.md, "third session"). A run stored
by an older version, another tool, or damaged, must never be taken for one whose process died."""

from __future__ import annotations

import socket

import pytest

from batchtap._stale import owner_gone


@pytest.mark.parametrize("pid", [None, "1", 1.0, True, False], ids=["none", "text", "float", "true", "false"])
def test_an_environment_without_an_integer_pid_is_never_an_owner_gone(pid: object) -> None:
    environment = {"host": socket.gethostname(), "pid": pid, "pid_started": "0"}
    assert owner_gone(environment) is False


def test_a_dead_pid_on_this_host_is_an_owner_gone() -> None:
    """The same check's other side, so the one above cannot pass by answering False always: a pid
    far above the kernel's limit has no process."""
    assert owner_gone({"host": socket.gethostname(), "pid": 2**22 + 12345}) is True
