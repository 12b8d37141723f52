"""Which stack frames are the user's own code, and where a read sits in a stack.

``batchtap audit`` attributes each host read to the innermost frame in the user's own files, and
names the library frame that made the read (if any) under that line. This module only classifies
file names and walks frames; it imports nothing heavy (no torch), so it is cheap to test.

A file is the user's when it lies under one of the given roots (by default the audited script's
folder) and is not inside batchtap, torch, the standard library or an installed package
(``site-packages``/``dist-packages``, the interpreter's prefix).
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from types import FrameType

__all__ = ["Kind", "Site", "Located", "FrameClassifier"]


class Kind(Enum):
    """What a frame's file is."""

    PLUMBING = "plumbing"  #: the audit's own hooks and torch's dispatch / tensor-dunder layer
    BATCHTAP = "batchtap"
    LIBRARY = "library"  #: torch, the standard library, installed packages, files outside the roots
    USER = "user"


@dataclass(frozen=True, slots=True)
class Site:
    """One source line: file, line number, function and the line's text."""

    filename: str
    lineno: int
    function: str
    text: str


@dataclass(frozen=True, slots=True)
class Located:
    """Where a read happened.

    Attributes:
        user: the innermost frame in the user's files (``None``: no such frame on the stack).
        via: the innermost library frame that made the read, when the read did not happen on the
            user's line itself (``None``: the user's line read the value directly).
        in_batchtap: a batchtap frame lies between the user's line and the read: batchtap's own
            read (its labelled sync points), not the user's.
    """

    user: Site | None
    via: Site | None
    in_batchtap: bool


def _dir(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


def _site(frame: FrameType) -> Site:
    filename, lineno = frame.f_code.co_filename, frame.f_lineno or 0
    text = linecache.getline(filename, lineno).strip()
    return Site(filename, lineno, frame.f_code.co_name, text)


class FrameClassifier:
    """Classify frames by file name (cached per file) and locate reads in a stack.

    Args:
        roots: folders whose files are the user's. Empty: every file that is not batchtap, torch,
            the standard library or an installed package.
        plumbing: extra files or folders whose frames are skipped entirely (the audit's hooks).

    Example:
        >>> c = FrameClassifier(["/home/me/proj"])
        >>> c.kind("/home/me/proj/train.py"), c.kind(os.__file__)
        (<Kind.USER: 'user'>, <Kind.LIBRARY: 'library'>)
    """

    def __init__(self, roots: Iterable[str] = (), *, plumbing: Sequence[str] = ()) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        self._batchtap = _dir(here)
        self._roots = tuple(_dir(r) for r in roots)
        self._plumbing = tuple(os.path.realpath(p) for p in plumbing)
        self._plumbing_dirs = tuple(_dir(p) for p in plumbing)
        torch_dir = self._module_dir("torch")
        # torch's own layers between a tensor method and the dispatcher: a read made there is the
        # tensor's (``print(t)``, ``f"{t:.3f}"``, ``t.__array__``), so the caller is the real site.
        self._torch_plumbing: tuple[str, ...] = ()
        if torch_dir:
            self._torch_plumbing = tuple(
                os.path.join(torch_dir, p)
                for p in (
                    "_tensor.py",
                    "_tensor_str.py",
                    "_compile.py",
                    "_ops.py",
                    "overrides.py",
                    "_dynamo",
                    os.path.join("utils", "_python_dispatch.py"),
                )
            )
        libs = {_dir(p) for p in sysconfig.get_paths().values() if p}
        libs |= {_dir(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)}
        if torch_dir:
            libs.add(_dir(torch_dir))
        self._libs = tuple(sorted(libs))
        self._cache: dict[str, Kind] = {}

    @staticmethod
    def _module_dir(name: str) -> str | None:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        return os.path.dirname(os.path.realpath(path)) if path else None

    def kind(self, filename: str) -> Kind:
        """The kind of a frame whose code comes from ``filename``."""
        found = self._cache.get(filename)
        if found is None:
            found = self._cache[filename] = self._classify(filename)
        return found

    def _classify(self, filename: str) -> Kind:
        if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>, <stdin>
            return Kind.LIBRARY
        path = os.path.realpath(filename)
        if path in self._plumbing or path.startswith(self._torch_plumbing + self._plumbing_dirs):
            return Kind.PLUMBING
        if path.startswith(self._batchtap):
            return Kind.BATCHTAP
        parts = path.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts or path.startswith(self._libs):
            return Kind.LIBRARY
        if not self._roots or path.startswith(self._roots):
            return Kind.USER
        return Kind.LIBRARY

    def locate(self, frame: FrameType | None) -> Located:
        """Walk outwards from ``frame`` (the innermost) to the first user frame."""
        via: Site | None = None
        in_batchtap = False
        while frame is not None:
            kind = self.kind(frame.f_code.co_filename)
            if kind is Kind.USER:
                return Located(_site(frame), via, in_batchtap)
            if kind is Kind.BATCHTAP:
                in_batchtap = True
            if kind is not Kind.PLUMBING and via is None:
                via = _site(frame)
            frame = frame.f_back
        return Located(None, via, in_batchtap)

    def short(self, filename: str) -> str:
        """A library file's name as a reader knows it: from the package down (``torch/optim/adamw.py``)."""
        path = os.path.realpath(filename)
        parts = path.split(os.sep)
        for marker in ("site-packages", "dist-packages"):
            if marker in parts:
                return "/".join(parts[len(parts) - parts[::-1].index(marker) :])
        for lib in self._libs:
            if path.startswith(lib):
                return os.path.relpath(path, lib).replace(os.sep, "/")
        return filename
