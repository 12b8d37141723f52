"""The environment a run records: host, process, versions, git commit."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from typing import Any

import torch

__all__ = ["environment"]


def _git_commit(cwd: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=2, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment(device: str | None = None) -> dict[str, Any]:
    """Facts about this process, JSON-serialisable.

    Example:
        >>> env = environment()
        >>> env["torch"] == torch.__version__ and env["pid"] == os.getpid()
        True
    """
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "cwd": os.getcwd(),
        "git_commit": _git_commit(os.getcwd()),
        "argv": list(sys.argv),
        "device": device,
    }
