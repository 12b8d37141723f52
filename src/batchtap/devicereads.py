"""Host reads of tensors that would live on the accelerator, found on any machine (taint tracking).

:class:`batchtap.hostreads.HostReadCounter` counts every host read. On a CPU machine most of those
would never sync on a GPU: numpy indexing with a CPU tensor, an optimizer's CPU step counter, a
DataLoader's seed. :class:`DeviceReadTracker` tells them apart by tracking which tensors would be
on the device when the same script runs on a GPU ("device tensors"):

* every ``nn.Parameter``, and a module's buffers once the script calls ``module.to(device)``;
* a tensor moved by the script: ``t.to(device)``, ``t.to(other_device_tensor)``. On a CPU
  machine the script's ``device`` is ``"cpu"``, so ``t.to(device)`` and ``t.to("cpu")`` look the
  same; the call's source line tells them apart: a line that names ``"cpu"``/``'cpu'`` (or
  ``.cpu()``) copies to the host, any other ``.to(...)`` moves to the script's device. The moved
  tensor is a new alias of the same storage, so the host original keeps its own status;
* a tensor created on a line of the user's own files that passes a device (``torch.zeros(3,
  device=device)``) and does not name ``"cpu"``;
* any tensor on a non-CPU device (a real accelerator, when the audit runs on a GPU);
* every output of an op that takes a device tensor (a ``TorchDispatchMode`` marks them, in a
  weak-keyed table, so the marks die with the tensors), in-place results included. A ``copy_``
  keeps its destination's status: copying into a host buffer does not move the buffer.

Reads recorded (each with whether the tensor read is a device tensor, and where in the stack):
``item``/``float``/``int``/``bool``/``if t:``/``f"{t:.3f}"`` (``_local_scalar_dense``); blocking
copies to the host (``.cpu()``, ``.to("cpu")``, ``host.copy_(t)``); ``.tolist()``, ``.numpy()``,
``np.asarray(t)``, ``print(t)``; and ops whose output shape depends on the values, which wait for
the device to know it (``nonzero``, indexing with a boolean mask, ``masked_select``, ``unique``,
``equal``).

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> with DeviceReadTracker() as tracker:
    ...     x = torch.ones(4, 2)
    ...     n = int(x.sum())             # a CPU tensor: would not sync on a GPU
    ...     loss = model(x).pow(2).mean()
    ...     v = loss.item()              # derived from the parameters: a device read
    >>> [(r.op, r.device) for r in tracker.reads]
    [('item/float/bool', False), ('item/float/bool', True)]
"""

from __future__ import annotations

import linecache
import re
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from batchtap._userframes import FrameClassifier, Kind, Site

__all__ = ["DeviceRead", "DeviceReadTracker"]

_aten = torch.ops.aten
_HOST = ("cpu", "meta")
_NAMES_CPU = re.compile(r"""\.cpu\(|["']cpu["']""")
# Ops that wait for the device because their output's shape depends on its values.
_SHAPE_READS: dict[Any, str] = {
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.equal.default: "equal",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
}
_FACTORY_INPUT = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}  # torch.tensor(data, device=...)


@dataclass(frozen=True, slots=True)
class DeviceRead:
    """One host read.

    Attributes:
        op: what read: ``item/float/bool``, ``to(cpu)``, ``copy_ to host``, ``Tensor.tolist``, ``nonzero``...
        device: the tensor read is a device tensor: on a GPU this read makes the CPU wait.
        user: the innermost line in the user's own files (``None``: none on the stack).
        via: the library line that made the read, when it is not the user's line itself.
        in_batchtap: made inside batchtap's own code (its labelled sync points), not the user's.
    """

    op: str
    device: bool
    user: Site | None = None
    via: Site | None = None
    in_batchtap: bool = False


def _is_real_device(t: torch.Tensor) -> bool:
    return t.device.type not in _HOST


class DeviceReadTracker(TorchDispatchMode):
    """Context manager: track device tensors and record host reads on the thread that entered it.

    While active, ``Tensor.to``/``cpu``/``tolist``/``numpy``/``__array__``/``__repr__``/``data`` and
    ``nn.Module.to`` are wrapped (restored on exit): the calls that move tensors or read them
    without passing the dispatcher.

    Args:
        classifier: which files are the user's, for attributing reads (default: every file that is
            not batchtap, torch, the standard library or an installed package).
    """

    def __init__(self, classifier: FrameClassifier | None = None) -> None:
        super().__init__()
        self.classifier = classifier or FrameClassifier(plumbing=[__file__])
        self.reads: list[DeviceRead] = []
        self._marked: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._thread: int | None = None
        self._saved: list[tuple[type, str, Any]] = []
        self._depth = 0  # >0 inside a wrapped method: its own dispatches are not reads of their own
        self._bypass = 0  # >0 inside Module.to: its per-tensor .to calls are plain
        self._writes: dict[Any, list[tuple[int, str]]] = {}  # op -> the arguments it writes into

    # -- which tensors are device tensors -------------------------------------------------------

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` would be on the accelerator when the script runs on one."""
        if _is_real_device(t):
            return True
        return isinstance(t, torch.nn.Parameter) or t in self._marked

    def mark(self, t: torch.Tensor) -> None:
        """Treat the host tensor ``t`` as a device tensor from now on."""
        if not _is_real_device(t):
            self._marked[t] = True

    def _unmark(self, t: torch.Tensor) -> None:
        self._marked.pop(t, None)

    def _carries_taint(self, tensors: Iterable[torch.Tensor]) -> bool:
        # A real accelerator tensor does not taint host outputs: on a GPU machine a host result of
        # an op on device tensors (a .cpu() copy) is a host tensor.
        return any(not _is_real_device(t) and (isinstance(t, torch.nn.Parameter) or t in self._marked) for t in tensors)

    # -- recording ------------------------------------------------------------------------------

    @property
    def device_reads(self) -> list[DeviceRead]:
        """The reads of device tensors: the ones that sync on a GPU."""
        return [r for r in self.reads if r.device]

    def _record(self, op: str, device: bool, frame: FrameType | None) -> None:
        if threading.get_ident() != self._thread:
            return
        where = self.classifier.locate(frame)
        self.reads.append(DeviceRead(op, device, where.user, where.via, where.in_batchtap))

    def _on_user_line_naming_a_device(self, frame: FrameType | None) -> bool:
        """A factory call made directly on a user line that passes a device, not ``"cpu"``."""
        while frame is not None and self.classifier.kind(frame.f_code.co_filename) is Kind.PLUMBING:
            frame = frame.f_back
        if frame is None or self.classifier.kind(frame.f_code.co_filename) is not Kind.USER:
            return False
        where = self.classifier.locate(frame).user
        text = where.text if where else ""
        return "device" in text and not _NAMES_CPU.search(text)

    # -- the dispatcher -------------------------------------------------------------------------

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if self._depth == 0:
            self._check_read(func, args, kwargs)
        out = func(*args, **kwargs)
        if func is _aten.copy_.default:
            return out  # the destination stays where it is
        taint = self._carries_taint(tensors)
        if not taint and (not tensors or func in _FACTORY_INPUT):
            taint = self._on_user_line_naming_a_device(sys._getframe(1))
        if taint:
            for o in tree_flatten((out, self._written(func, args, kwargs)))[0]:
                if isinstance(o, torch.Tensor):
                    self.mark(o)
        return out

    def _written(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The arguments ``func`` writes into (``out=``, in-place ops that return nothing, like
        GradScaler's ``found_inf`` check): written with device values, they hold device values."""
        where = self._writes.get(func)
        if where is None:
            where = self._writes[func] = [
                (i, a.name)
                for i, a in enumerate(func._schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            ]
        return [args[i] if i < len(args) else kwargs.get(name) for i, name in where]

    def _check_read(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if func is _aten._local_scalar_dense.default:
            self._record("item/float/bool", self.is_device(args[0]), sys._getframe(2))
        elif func in _SHAPE_READS:
            self._record(_SHAPE_READS[func], self.is_device(args[0]), sys._getframe(2))
        elif func is _aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            self._record("boolean-mask index", self.is_device(args[0]), sys._getframe(2))
        elif func is _aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if self.is_device(src) and not self.is_device(dst) and not non_blocking:
                self._record("copy_ to host", True, sys._getframe(2))

    # -- the wrapped methods --------------------------------------------------------------------

    def __enter__(self) -> DeviceReadTracker:
        self._thread = threading.get_ident()
        for name in ("tolist", "numpy", "__array__"):
            self._patch(torch.Tensor, name, self._reader(name, getattr(torch.Tensor, name)))
        # Printing runs with dispatch modes disabled (torch._tensor_str): one read per print.
        self._patch(torch.Tensor, "__repr__", self._reader("__repr__", torch.Tensor.__repr__, op="print/repr"))
        self._patch(torch.Tensor, "cpu", self._cpu(torch.Tensor.cpu))
        self._patch(torch.Tensor, "to", self._to(torch.Tensor.to))
        self._patch(torch.Tensor, "data", self._data(torch._C.TensorBase.data))  # type: ignore[attr-defined]
        self._patch(torch.nn.Module, "to", self._module_to(torch.nn.Module.to))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved.clear()

    def _patch(self, owner: type, name: str, replacement: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, replacement)

    def _here(self) -> bool:
        return threading.get_ident() == self._thread and self._depth == 0

    def _plain(self, original: Callable[..., Any], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._depth += 1
        try:
            return original(tensor, *args, **kwargs)
        finally:
            self._depth -= 1

    def _alias(self, tensor: torch.Tensor, *, device: bool) -> torch.Tensor:
        """A new tensor object over the same storage, so that a "moved" copy and its source can
        differ in status on a machine where the move is a no-op."""
        if tensor.is_leaf and tensor.requires_grad:
            # An alias would be a non-leaf, and an optimizer refuses it; on the CPU the script
            # gets this very tensor back, so it is the one that takes the new status.
            return self._restatus(tensor, device=device)
        try:
            alias = tensor.view_as(tensor)
        except RuntimeError:  # layouts without views (sparse): the tensor itself takes the status
            return self._restatus(tensor, device=device)
        if device:
            self.mark(alias)
        else:
            self._unmark(alias)
        return alias

    def _restatus(self, tensor: torch.Tensor, *, device: bool) -> torch.Tensor:
        if device:
            self.mark(tensor)
        elif not isinstance(tensor, torch.nn.Parameter):
            self._unmark(tensor)
        return tensor

    def _reader(self, name: str, original: Callable[..., Any], *, op: str | None = None) -> Callable[..., Any]:
        tracker = self
        label = op or f"Tensor.{name}"

        def wrapped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tracker._here():
                tracker._record(label, tracker.is_device(tensor), sys._getframe(1))
            return tracker._plain(original, tensor, *args, **kwargs)

        wrapped.__name__ = name
        return wrapped

    def _cpu(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self

        def cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not tracker._here() or not tracker.is_device(tensor):
                return original(tensor, *args, **kwargs)
            tracker._record("to(cpu)", True, sys._getframe(1))
            out = tracker._plain(original, tensor, *args, **kwargs)
            if out is not tensor or isinstance(tensor, torch.nn.Parameter):
                return out  # module.cpu() keeps its parameters (a new object there would replace .data)
            return tracker._alias(out, device=False)

        return cpu

    def _to(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not tracker._here() or tracker._bypass:
                return original(tensor, *args, **kwargs)
            try:
                device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            except (TypeError, RuntimeError):
                return original(tensor, *args, **kwargs)  # let torch word its own error
            if device is None or device.type not in _HOST or tensor.device.type not in _HOST:
                # no move, a real move to an accelerator, or from one (a read unless non_blocking)
                if device is not None and device.type in _HOST and _is_real_device(tensor) and not non_blocking:
                    tracker._record("to(cpu)", True, sys._getframe(1))
                return tracker._plain(original, tensor, *args, **kwargs)
            other = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("other"))
            if isinstance(other, torch.Tensor):
                to_device = tracker.is_device(other)
            else:
                to_device = not _NAMES_CPU.search(_line(sys._getframe(1)))
            from_device = tracker.is_device(tensor)
            out = tracker._plain(original, tensor, *args, **kwargs)
            if to_device == from_device:
                return out  # host to host, or device to device: nothing moves
            if not to_device and not non_blocking:
                tracker._record("to(cpu)", True, sys._getframe(1))
            return tracker._alias(out, device=to_device) if out is tensor else out

        return to

    def _data(self, descriptor: Any) -> property:
        tracker = self

        def get(tensor: torch.Tensor) -> torch.Tensor:
            data: torch.Tensor = descriptor.__get__(tensor)
            if tracker.is_device(tensor):
                tracker.mark(data)
            return data

        def set_(tensor: torch.Tensor, value: torch.Tensor) -> None:
            descriptor.__set__(tensor, value)

        return property(get, set_, doc=descriptor.__doc__)

    def _module_to(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self

        def to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != tracker._thread:
                return original(module, *args, **kwargs)
            tracker._bypass += 1
            try:
                out = original(module, *args, **kwargs)
            finally:
                tracker._bypass -= 1
            try:
                device = torch._C._nn._parse_to(*args, **kwargs)[0]
            except (TypeError, RuntimeError):
                return out
            if device is not None and not _NAMES_CPU.search(_line(sys._getframe(1))):
                for buffer in module.buffers():
                    tracker.mark(buffer)
            return out

        return to


def _line(frame: FrameType) -> str:
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno or 0)
