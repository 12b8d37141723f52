"""Count host reads of tensor values: the benchmarks' own referee for "zero syncs per step".

A host read is anything that makes the host wait for a tensor's value: on CUDA it stalls the CPU
until the GPU has caught up (``loss.item()``, ``float(t)``, ``bool(t)``, ``if loss > x``, ``.cpu()``,
``.tolist()``, ``.numpy()``). :class:`HostReadCounter` counts them on any device, so a CPU-only run
shows what the same loop would do on a GPU:

* a ``TorchDispatchMode`` sees ``aten._local_scalar_dense`` (what ``item``/``float``/``int``/``bool``
  and ``format`` lower to) and device->host copies (``_to_copy`` / ``copy_`` from a non-CPU device
  into CPU memory). Blocking copies are host reads; ``non_blocking=True`` copies are queued, not
  waited for, and are tallied separately in :attr:`HostReadCounter.nonblocking_copies`;
* ``Tensor.item``, ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.__array__`` are wrapped while the
  counter is active, because ``tolist``/``numpy``/``__array__`` of a CPU tensor bypass the
  dispatcher. A read made inside a wrapped call is counted once, not once per layer.

This deliberately does not import ``batchtap.hostreads``: a benchmark's referee should not be the
code under test. It is a plain module (no package), so tests can load it by path::

    sys.path.insert(0, str(repo / "bench")); from _hostreads import HostReadCounter

Example:
    >>> import torch
    >>> x = torch.ones(3)
    >>> with HostReadCounter() as c:
    ...     y = (x * 2).sum()   # no read
    ...     v = y.item()        # one read
    ...     w = x.tolist()      # one read (bypasses the dispatcher on CPU)
    >>> c.count, dict(c.by_op)
    (2, {'Tensor.item': 1, 'Tensor.tolist': 1})
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReadCounter"]

_aten = torch.ops.aten
_WRAPPED = ("item", "tolist", "numpy", "__array__")


def _off_host(t: object) -> bool:
    """Whether ``t`` is a tensor whose values live off the host (cuda, xpu, mps, ...)."""
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def _is_cpu(device: object) -> bool:
    return device is not None and torch.device(device).type == "cpu"  # type: ignore[arg-type]


class HostReadCounter(TorchDispatchMode):
    """Context manager counting host reads made by the thread that entered it.

    Other threads (a logger's writer thread, batchtap's pipeline thread) are not counted: they do
    not stall the training loop's launch queue. Pass ``all_threads=True`` to count them too (the
    wrapped ``Tensor`` methods are process-wide; the dispatch mode only sees the entering thread).

    Attributes:
        count: host reads seen so far (the number to keep at 0 per step).
        by_op: reads per kind, e.g. ``{"Tensor.item": 200}``.
        nonblocking_copies: non-blocking device->host copies (queued, not waited for).
    """

    def __init__(self, *, all_threads: bool = False) -> None:
        super().__init__()
        self.all_threads = all_threads
        self.by_op: collections.Counter[str] = collections.Counter()
        self.nonblocking_copies = 0
        self._thread: int | None = None
        self._saved: dict[str, Callable[..., Any]] = {}
        self._local = threading.local()  # per-thread depth inside a wrapped method

    @property
    def count(self) -> int:
        """Host reads seen so far."""
        return sum(self.by_op.values())

    def reset(self) -> None:
        """Forget everything seen so far (e.g. at the end of a warm-up)."""
        self.by_op.clear()
        self.nonblocking_copies = 0

    # ------------------------------------------------------------------ recording

    def _mine(self) -> bool:
        return self.all_threads or threading.get_ident() == self._thread

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _record(self, op: str) -> None:
        if self._mine():
            self.by_op[op] += 1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._depth() == 0:
            if func is _aten._local_scalar_dense.default:
                self._record("item/float/bool")
            elif func is _aten._to_copy.default and _off_host(args[0]) and _is_cpu(kwargs.get("device")):
                self._copy(bool(kwargs.get("non_blocking", False)), "to(cpu)")
            elif func is _aten.copy_.default and _off_host(args[1]) and _is_cpu(args[0].device):
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                self._copy(bool(non_blocking), "copy_ to cpu")
        return func(*args, **kwargs)

    def _copy(self, non_blocking: bool, op: str) -> None:
        if non_blocking:
            if self._mine():
                self.nonblocking_copies += 1
        else:
            self._record(op)

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> HostReadCounter:
        self._thread = threading.get_ident()
        for name in _WRAPPED:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        try:
            super().__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._restore()

    def _restore(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter, local = self, self._local

        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "depth", 0)
            if depth == 0:
                counter._record(f"Tensor.{name}")
            local.depth = depth + 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                local.depth = depth

        wrapped.__name__ = name
        wrapped.__qualname__ = f"Tensor.{name}"
        return wrapped
