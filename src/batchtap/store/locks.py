"""Who holds a lock on a SQLite store: the processes with a POSIX lock on its files (Linux
``/proc/locks``), so that "database is locked" can name the holder."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["lock_holders", "describe_lock"]


def lock_holders(paths: list[Path]) -> list[int]:
    """Process ids holding a POSIX/OFD lock on any of ``paths`` (empty where ``/proc/locks`` is
    not available). SQLite locks the database file, and in WAL mode its ``-shm`` index."""
    keys = set()
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        keys.add((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
    if not keys:
        return []
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return []
    pids: list[int] = []
    for line in text.splitlines():
        fields = line.split()
        # "1: POSIX  ADVISORY  WRITE 4242 00:2b:131 0 EOF" (a blocked waiter's line has "->")
        if len(fields) < 6 or "->" in fields[1]:
            continue
        try:
            pid = int(fields[4])
            major, minor, inode = fields[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
        except ValueError:
            continue
        if key in keys and pid > 0 and pid not in pids:
            pids.append(pid)
    return pids


def describe_lock(db: Path) -> str:
    """Who holds the store's lock, as a phrase: 'process 4242 (python)', or that it is unknown."""
    pids = lock_holders([db, db.with_name(db.name + "-shm"), db.with_name(db.name + "-wal")])
    if not pids:
        return "another connection (its process could not be identified)"
    parts = []
    for pid in pids:
        if pid == os.getpid():
            parts.append(f"another connection in this process (pid {pid})")
            continue
        try:
            # the program name only: a command line may hold secrets
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            name = "?"
        parts.append(f"process {pid} ({name})")
    return ", ".join(parts)
