"""Count host reads of tensor values: the operations that make the CPU wait for the GPU.

On CUDA, ``.item()``, ``float(t)``, ``bool(t)``, ``if loss > x:``, ``.cpu()``, ``.tolist()`` and
``.numpy()`` all block the host until the device has caught up. :class:`HostReadCounter` counts
them on any device, so a CPU-only test proves the CUDA path free of them:

* a ``TorchDispatchMode`` sees ``aten._local_scalar_dense`` (what ``item``/``float``/``bool``
  lower to) and blocking copies from a non-CPU device to the CPU;
* ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.__array__`` bypass the dispatcher for CPU
  tensors, so they are wrapped while the counter is active.

Used by the test suite and the benchmarks. It counts every read, of host tensors too; ``batchtap
audit`` uses :class:`batchtap.devicereads.DeviceReadTracker`, which tells apart the reads of
tensors that would live on the accelerator.

Example:
    >>> import torch
    >>> x = torch.ones(3)
    >>> with HostReadCounter() as reads:
    ...     y = x * 2          # no read
    ...     v = y.sum().item() # one read
    >>> reads.count, reads.reads[0].op
    (1, 'item/float/bool')
"""

from __future__ import annotations

import dataclasses
import os
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostRead", "HostReadCounter"]

_aten = torch.ops.aten
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


@dataclasses.dataclass(frozen=True, slots=True)
class HostRead:
    """One host read: what did it, and where in user code (``file:line``), when asked to locate."""

    op: str
    filename: str | None = None
    lineno: int | None = None
    line: str | None = None


def _is_device_to_host(src: object, dst_device: torch.device | str | None) -> bool:
    if not isinstance(src, torch.Tensor) or src.device.type in ("cpu", "meta"):
        return False
    return dst_device is not None and torch.device(dst_device).type == "cpu"


class HostReadCounter(TorchDispatchMode):
    """Context manager counting host reads on the thread that entered it.

    Args:
        locate: also record the first stack frame outside torch and batchtap for each read (slower;
            gives each read a ``file:line``).
    """

    def __init__(self, *, locate: bool = False) -> None:
        super().__init__()
        self.locate = locate
        self.reads: list[HostRead] = []
        self._thread: int | None = None
        self._saved: dict[str, Callable[..., Any]] = {}
        self._depth = 0  # >0 while inside a wrapped method, so its own dispatch is not counted twice

    @property
    def count(self) -> int:
        """Reads seen so far."""
        return len(self.reads)

    def reset(self) -> None:
        """Forget the reads seen so far."""
        self.reads.clear()

    def _record(self, op: str) -> None:
        if threading.get_ident() != self._thread:
            return
        if not self.locate:
            self.reads.append(HostRead(op))
            return
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = os.path.abspath(frame.filename)
            if not path.startswith((_PACKAGE_DIR, _TORCH_DIR)) and "importlib" not in path:
                self.reads.append(HostRead(op, frame.filename, frame.lineno, (frame.line or "").strip()))
                return
        self.reads.append(HostRead(op))

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._depth == 0:
            if func is _aten._local_scalar_dense.default:
                self._record("item/float/bool")
            # A non_blocking device->host copy is queued, not waited for (into pinned memory; into
            # pageable memory CUDA still waits, which the GPU tests' sync debug mode catches).
            elif func is _aten._to_copy.default and _is_device_to_host(args[0], kwargs.get("device")):
                if not kwargs.get("non_blocking", False):
                    self._record("to(cpu)")
            elif func is _aten.copy_.default and _is_device_to_host(args[1], args[0].device):
                if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                    self._record("copy_ to cpu")
        return func(*args, **kwargs)

    def __enter__(self) -> HostReadCounter:
        self._thread = threading.get_ident()
        for name in ("tolist", "numpy", "__array__"):
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter._depth == 0:
                counter._record(f"Tensor.{name}")
            counter._depth += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._depth -= 1

        wrapped.__name__ = name
        return wrapped
