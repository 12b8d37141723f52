"""What a killed process leaves behind, recognised by a later one: shared-memory segments and runs
still marked ``running``.

A SLURM/Kubernetes/OOM kill ends a whole process group at once: the training process, its pipeline
process and Python's resource tracker together, so nothing of the dead process can clean up. The
dead owner is recognised by what it recorded instead:

* a segment's name carries its owner's pid, process group and start time
  (``bt<pid>_<pgid>_<start>_<token>``); a later batchtap process on the host removes those whose
  owner is gone and whose process group has no live process left (:func:`sweep_segments`): an
  orphaned pipeline process (same group) may still be reading one, or not have attached to it yet;
* a run's environment carries ``host``, ``pid`` and ``pid_started`` (boot id and start time, see
  :func:`process_started`): a reader on the same host shows a ``running`` run whose owner is gone as
  ``killed`` (:func:`owner_gone`).

A pid alone is not enough: pids are reused. The start time (in clock ticks since boot, from
``/proc/<pid>/stat``) together with the boot id tells one process from another. Where ``/proc`` is
missing (macOS, Windows) nothing is removed and no run is called killed: only a certain death counts.

Segments are also kept out of Python's resource tracker: it would print a "leaked shared_memory
objects" warning on the user's stderr whenever the training process is SIGKILLed alone (its pipeline
process then reads every published block and removes the segment by this module's rule).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from pathlib import Path
from typing import Any

__all__ = [
    "process_started",
    "owner_gone",
    "segment_name",
    "segment_owner_gone",
    "sweep_segments",
    "untrack",
    "unlink_segment",
    "unlink_if_owner_gone",
    "segment_abandoned",
]

SHM_DIR = Path("/dev/shm")
_SEGMENT = re.compile(r"^bt(\d+)_(\d+)_(\d+)_[0-9a-f]+$")
_swept = False  # sweep_segments(once=True) ran in this process


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), or
    None when there is no such process or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after its last ')'
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def process_started(pid: int | None = None) -> str | None:
    """``"<boot id>/<start ticks>"`` of a process (this one by default): the same string for the
    same process, another for a later process with the same pid. None without ``/proc``.

    Example:
        >>> process_started() == process_started(os.getpid())
        True
    """
    ticks = _start_ticks(os.getpid() if pid is None else pid)
    boot = _boot_id()
    return None if ticks is None or boot is None else f"{boot}/{ticks}"


def _pid_exists(pid: int) -> bool:
    """Whether a live process has ``pid``: a zombie (killed, not yet reaped by its parent) is none."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # gone meanwhile; without /proc, kill() said it exists
    except OSError:
        return True
    state = stat[stat.rfind(")") + 2 :].split()[:1]
    return state not in (["Z"], ["X"])  # zombie, dead


def owner_gone(environment: dict[str, Any]) -> bool:
    """Whether the process a run's environment names (``host``, ``pid``, ``pid_started``) is
    certainly gone: on this host, and no process has that pid, or the one that has it started at
    another time (a reused pid). False when that cannot be told (another host, no pid recorded,
    no ``/proc`` to compare start times)."""
    if environment.get("host") != socket.gethostname():
        return False
    pid = environment.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return False
    if pid == os.getpid():
        return False
    if not _pid_exists(pid):
        return True
    started = environment.get("pid_started")
    if not isinstance(started, str):
        return False  # alive, or reused: without the start time it cannot be told
    now = process_started(pid)
    return now is not None and now != started


def segment_name() -> str:
    """A name for a new segment that says whose it is: ``bt<pid>_<pgid>_<start ticks>_<token>``."""
    pid = os.getpid()
    ticks = _start_ticks(pid)
    return f"bt{pid}_{os.getpgid(0)}_{ticks if ticks is not None else 0}_{secrets.token_hex(4)}"


def segment_owner_gone(name: str) -> bool:
    """Whether the process that made segment ``name`` (one :func:`segment_name` gave) is gone."""
    match = _SEGMENT.match(name.lstrip("/"))
    if match is None:
        return False
    pid, ticks = int(match.group(1)), int(match.group(3))
    if not _pid_exists(pid):
        return True
    now = _start_ticks(pid)
    return ticks != 0 and now is not None and now != ticks  # the pid was reused


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process belongs to process group ``pgid``; True when that
    cannot be told (no ``/proc``): only a certainly abandoned segment is removed."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # fields[0]: state, fields[2]: process group
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def segment_abandoned(name: str) -> bool:
    """Whether nobody can still use segment ``name``: its owner is gone and no live process is
    left in the owner's process group (where its pipeline process lives, reading the segment or
    about to attach to it). A process-group kill leaves the group empty at once."""
    match = _SEGMENT.match(name.lstrip("/"))
    return match is not None and segment_owner_gone(name) and not _group_alive(int(match.group(2)))


def untrack(name: str) -> None:
    """Take a segment out of Python's resource tracker (this module's rule removes it instead)."""
    if os.name != "posix":
        return
    from multiprocessing import resource_tracker

    try:
        resource_tracker.unregister(name if name.startswith("/") else "/" + name, "shared_memory")
    except Exception:  # noqa: BLE001 - a tracker that is gone has nothing to forget
        pass


def unlink_segment(name: str) -> bool:
    """Remove segment ``name`` without telling the resource tracker (see :func:`untrack`); False
    when it was already gone."""
    if os.name != "posix":
        from multiprocessing import shared_memory

        try:
            shared_memory.SharedMemory(name=name).unlink()
        except FileNotFoundError:
            return False
        return True
    import _posixshmem  # type: ignore[import-not-found]  # CPython's own, used by shared_memory

    try:
        _posixshmem.shm_unlink(name if name.startswith("/") else "/" + name)
    except FileNotFoundError:
        return False
    return True


def unlink_if_owner_gone(name: str) -> None:
    """Remove segment ``name`` when the process that made it is gone (a reader's exit hook)."""
    if segment_owner_gone(name):
        unlink_segment(name)


def sweep_segments(*, once: bool = False, where: Path = SHM_DIR) -> list[str]:
    """Remove the segments of batchtap processes that are gone (:func:`segment_abandoned`);
    returns their names.

    ``once``: only at the first call in this process (the Tap's segments call it when they make
    their first segment). A segment whose owner is alive, or that is not batchtap's, is never
    touched. A pipeline process still reading a removed segment keeps its mapping: removing the
    name frees the memory only once the last process unmaps it.
    """
    global _swept
    if once and _swept:
        return []
    _swept = True
    try:
        names = [p.name for p in where.iterdir() if _SEGMENT.match(p.name)]
    except OSError:
        return []
    removed = []
    for name in names:
        if segment_abandoned(name) and unlink_segment(name):
            removed.append(name)
    return removed
