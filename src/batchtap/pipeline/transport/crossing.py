"""What crosses between the training process and its pipeline process, and how.

Messages travel as pickles over a pipe, in an :class:`Envelope` (its sequence number and, for a
request, the key its answer comes back under). A block's rows do not travel in the pipe: they
are written into the run's shared-memory segment (:mod:`batchtap.pipeline.transport.shm`) and a
:class:`Published` names the slot. The pipeline process answers with :class:`Ack`,
:class:`Reply` and what its :class:`~batchtap.pipeline.chain.control.Control` is told
(:class:`Posted`, :class:`Failed`, :class:`Judged`, :class:`Counted`).

Objects that belong to the training side (modules, optimizers, tensors, GradScalers) are never
copied into the pipeline process: they travel as references (pickle persistent ids) and come back
as the same objects. The pipeline process holds a :class:`HomeRef` instead, which it can pass
around but not use, and it never needs torch to unpickle one.

The pipeline process starts without the training script: spawning would run the script's
imports (torch, usually) in it before anything else. The script is imported there only if a
pickle names something defined in it (a sink class of the script, say).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import multiprocessing.spawn
import pickle
import sys
import threading
from collections.abc import Iterator
from typing import Any

from batchtap.pipeline.chain.messages import BlockRows, Handover, OpenChain, Request
from batchtap.pipeline.transport.shm import SegmentShape
from batchtap.records import Record

__all__ = [
    "Ack",
    "ChildChain",
    "Counted",
    "Envelope",
    "Failed",
    "HomeRef",
    "Judged",
    "Meeting",
    "Posted",
    "Published",
    "Reply",
    "dumps_to_child",
    "dumps_to_parent",
    "loads_from_child",
    "loads_from_parent",
    "without_main",
]

# ---------------------------------------------------------------------- to the pipeline process


@dataclasses.dataclass(frozen=True, slots=True)
class Published:
    """A block's rows, published in its chain's segment as block ``seq`` (the crossing form of
    :class:`~batchtap.pipeline.chain.messages.BlockRows`)."""

    chain: int
    seq: int
    logged: tuple[Record, ...] = ()
    index: int | None = None  # the block's number in its chain (BlockRows.index)


@dataclasses.dataclass(frozen=True, slots=True)
class ChildChain:
    """An :class:`~batchtap.pipeline.chain.messages.OpenChain` and the segment its blocks come through."""

    open: OpenChain
    segment: SegmentShape


@dataclasses.dataclass(frozen=True, slots=True)
class Meeting:
    """Where the pipeline processes of all ranks meet to make their own gloo group (the ``group`` of
    an ``OpenChain``'s reduction, in a pipeline process): a TCPStore served by rank 0."""

    host: str
    port: int


#: what the pipeline process is sent
Crossing = Handover | Request | Published | ChildChain


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    """One message to the pipeline process: ``seq`` orders and confirms it (-1: a resent preamble,
    never confirmed); ``key`` is where a request's answer goes (None for the rest)."""

    seq: int
    message: Crossing
    key: int | None = None


def rows_of(message: Published, data: Any) -> BlockRows:
    """The hand-over a published block stands for, once its rows were read from the segment."""
    return BlockRows(message.chain, data, message.logged, message.index)


# ---------------------------------------------------------------------- back to the training process


@dataclasses.dataclass(frozen=True, slots=True)
class Ack:
    """Every message up to ``seq`` was handled and its records are with the sinks."""

    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """The answer to the request sent under ``key``."""

    key: int
    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Posted:
    """The rules' verdict on a block (``Control.post``)."""

    verdict: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """A pipeline failure (``Control.fail``)."""

    error: BaseException


@dataclasses.dataclass(frozen=True, slots=True)
class Judged:
    """Block ``index`` of ``chain`` was judged; ``error``: the input error its values revealed
    (``Control.judged``)."""

    chain: int
    index: int
    error: BaseException | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Counted:
    """The run's anomaly counts so far (``Control.count_anomalies``)."""

    counts: dict[str, int]


Answer = Ack | Reply | Posted | Failed | Judged | Counted


# ---------------------------------------------------------------------- pickling across the boundary


class HomeRef:
    """In the pipeline process: a training-side object left at home (see the module docstring)."""

    def __init__(self, key: int, kind: str) -> None:
        self.key = key
        self.kind = kind

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{self.kind}.{name}: this {self.kind} lives in the training process, and batchtap's pipeline "
            "process only has a reference to it; code that runs in the pipeline (decoding, rules, sinks) "
            "cannot use it. Fix: read what you need on the training side (a metric's read_host()), or use "
            "Tap(pipeline='thread')"
        )

    def __reduce__(self) -> Any:  # pragma: no cover - HomeRefs travel by persistent id
        raise TypeError("a HomeRef only travels back to the training process")


def _home_types() -> tuple[type, ...]:
    """The training-side types that travel as references. Without torch loaded nothing is one."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    return (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.amp.GradScaler)


class _ToChild(pickle.Pickler):
    def __init__(self, file: io.BytesIO, refs: dict[int, object]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.refs = refs
        self.home = _home_types()

    def persistent_id(self, obj: object) -> Any:
        if self.home and isinstance(obj, self.home):
            self.refs[id(obj)] = obj
            return (id(obj), type(obj).__name__)
        return None

    def reducer_override(self, obj: object) -> Any:
        # torch's string types (``torch.__version__`` in a run's environment) travel as plain
        # strings: unpickling one would load torch in the pipeline process for a version string
        if isinstance(obj, str) and type(obj).__module__.startswith("torch"):
            return str, (str(obj),)
        return NotImplemented


class _FromParent(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, main_path: str | None) -> None:
        super().__init__(file)
        self.main_path = main_path

    def persistent_load(self, pid: Any) -> Any:
        return HomeRef(*pid)

    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__" and self.main_path and "__mp_main__" not in sys.modules:
            # a class of the training script: run its imports here now, as spawning would have
            multiprocessing.spawn.import_main_path(self.main_path)
        return super().find_class(module, name)


class _ToParent(pickle.Pickler):
    def persistent_id(self, obj: object) -> Any:
        return obj.key if isinstance(obj, HomeRef) else None


class _FromChild(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, refs: dict[int, object]) -> None:
        super().__init__(file)
        self.refs = refs

    def persistent_load(self, pid: Any) -> Any:
        return self.refs[pid]


def dumps_to_child(obj: object, refs: dict[int, object]) -> bytes:
    """Pickle ``obj`` for the pipeline process; training-side objects are kept in ``refs``."""
    buf = io.BytesIO()
    _ToChild(buf, refs).dump(obj)
    return buf.getvalue()


def loads_from_parent(data: bytes, main_path: str | None = None) -> Any:
    """In the pipeline process: what :func:`dumps_to_child` pickled, with :class:`HomeRef` s."""
    return _FromParent(io.BytesIO(data), main_path).load()


def dumps_to_parent(obj: object) -> bytes:
    """In the pipeline process: pickle ``obj`` for the training process (HomeRefs by key)."""
    buf = io.BytesIO()
    _ToParent(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads_from_child(data: bytes, refs: dict[int, object]) -> Any:
    """What :func:`dumps_to_parent` pickled, HomeRefs back to their objects."""
    return _FromChild(io.BytesIO(data), refs).load()


# ---------------------------------------------------------------------- starting the process

_HIDING = threading.Lock()


def main_path() -> str | None:
    """The training script's file (imported in the pipeline process only when a pickle needs it)."""
    return getattr(sys.modules.get("__main__"), "__file__", None)


@contextlib.contextmanager
def without_main() -> Iterator[None]:
    """Start spawned processes without running the training script's imports in them (see the
    module docstring): ``multiprocessing`` finds no script to prepare while this is entered."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    with _HIDING:
        saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
        main.__dict__.pop("__file__", None)
        main.__dict__["__spec__"] = None
        try:
            yield
        finally:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)
