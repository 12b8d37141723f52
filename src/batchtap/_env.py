"""The environment a run records: host, process, versions, git commit — with secrets scrubbed.

Whatever a run stores about its process (command line, config, environment) may be shown by
``batchtap show`` and copied to other stores, so passwords and tokens are replaced by ``***``
before anything is stored: URL passwords (``postgresql://u:***@h/db``), ``password=`` values,
the value of an option named like a secret (``--password x``, ``--api-key=x``, ``db.token=x``)
and config keys named like one.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch

from batchtap._stale import process_started
from batchtap.store.url import redact_text

__all__ = ["environment", "scrub_argv", "scrub_secrets"]

REDACTED = "***"
# a name that holds a secret: password, passwd, pwd, secret, token, api key, access key, credentials
_SECRET_NAME = re.compile(
    r"(pass(word|wd|phrase)?$|passwd|password|pwd|secret|token|api[-_.]?key|access[-_.]?key|private[-_.]?key"
    r"|credential|auth[-_.]?key|signature|cookie|session[-_.]?key)",
    re.IGNORECASE,
)
_OPTION = re.compile(r"^(--?[A-Za-z0-9][\w.-]*)(=)(.*)$", re.DOTALL)
_ASSIGN = re.compile(r"^([A-Za-z_+~][\w.+~-]*)(=)(.*)$", re.DOTALL)


def is_secret_name(name: str) -> bool:
    """Whether an option, key or variable name says it holds a secret.

    Example:
        >>> [is_secret_name(n) for n in ("--password", "db.pass", "HF_TOKEN", "api-key", "lr", "passes")]
        [True, True, True, True, False, False]
    """
    return bool(_SECRET_NAME.search(name.lstrip("-")))


def scrub_argv(argv: Sequence[str]) -> list[str]:
    """A command line with its secrets replaced by ``***``.

    Example:
        >>> scrub_argv(["train.py", "--db", "postgresql://bob:pw@h/x", "--password", "s3", "--token=t", "db.pass=x", "--lr", "3"])
        ['train.py', '--db', 'postgresql://bob:***@h/x', '--password', '***', '--token=***', 'db.pass=***', '--lr', '3']
    """
    out: list[str] = []
    hide_next = False
    for arg in argv:
        arg = str(arg)
        if hide_next and not arg.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        m = _OPTION.match(arg) or _ASSIGN.match(arg)
        if m and is_secret_name(m.group(1)):
            out.append(f"{m.group(1)}={REDACTED}")
            continue
        if arg.startswith("-") and "=" not in arg and is_secret_name(arg):
            hide_next = True  # --password VALUE: the next argument is the secret
        out.append(redact_text(arg))
    return out


def scrub_secrets(value: Any) -> Any:
    """A JSON-like value (config, environment) with secrets replaced by ``***``: the value of
    every key named like a secret, and passwords inside strings (URLs, ``password=``).

    Example:
        >>> scrub_secrets({"db": "postgresql://u:pw@h/x", "api_key": "abc", "lr": 0.1, "nested": [{"token": 1}]})
        {'db': 'postgresql://u:***@h/x', 'api_key': '***', 'lr': 0.1, 'nested': [{'token': '***'}]}
    """
    if isinstance(value, dict):
        return {
            k: (
                REDACTED
                if isinstance(k, str) and is_secret_name(k) and value[k] not in (None, "", False)
                else scrub_secrets(v)
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [scrub_secrets(v) for v in value]
    if isinstance(value, tuple):
        return tuple(scrub_secrets(v) for v in value)
    if isinstance(value, str):
        return redact_text(value)
    return value


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
        "pid_started": process_started(),  # with host and pid: tells a dead owner from a reused pid
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "cwd": os.getcwd(),
        "git_commit": _git_commit(os.getcwd()),
        "argv": scrub_argv(sys.argv),
        "device": device,
    }
