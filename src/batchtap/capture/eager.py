"""Keeping torch.compile out of ``Tap.step()``: dynamo marks without a per-call wrapper.

Traced by dynamo, ``Tap.step()`` would make it guard on the step counter and recompile every step
(host arrays and CUDA events cannot be traced anyway), so the Tap's step entry points carry the mark
``torch.compiler.disable`` puts on its wrapper: a compiled caller graph-breaks at the call. Torch's own
wrapper costs ~0.4 us a call even where nothing is compiled, a tenth of the short step path, so
:func:`eager` calls the method directly from eager code, and :func:`eager_entry` marks a method with no
wrapper at all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["eager", "eager_entry", "in_eager_code"]

T = TypeVar("T")

#: dynamo's frame-evaluation switch (private; absent: torch's own disable wrapper does it all)
_set_eval_frame: Callable[[Any], Any] | None = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "set_eval_frame", None
)


def _c_skip_code() -> Callable[[Any], None] | None:
    """Dynamo's "never compile this code object" mark, set through its C module: importing
    ``torch._dynamo`` for it (what ``torch._dynamo.eval_frame.skip_code`` needs) would cost every
    ``import batchtap`` seconds, for the few scripts that compile a caller of the Tap."""
    c = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    action = getattr(c, "_FrameAction", None)
    strategy = getattr(c, "_FrameExecStrategy", None)
    set_strategy = getattr(c, "set_code_exec_strategy", None)
    if action is None or strategy is None or set_strategy is None:
        return None
    skip = strategy(action.SKIP, action.DEFAULT)

    def skip_code(code: Any) -> None:
        set_strategy(code, skip)

    return skip_code


#: dynamo's list of code objects it never compiles (private, as above)
_skip_code: Callable[[Any], None] | None = _c_skip_code()


def eager(method: T) -> T:
    """Exclude ``method`` from torch.compile tracing: traced, dynamo would guard on the step
    counter and recompile every step (host arrays and events cannot be traced anyway).

    ``torch.compiler.disable`` does that with a wrapper that costs ~0.4 us per call even when
    nothing is compiled, a tenth of the short step path. This wrapper carries the same mark, so a
    compiled caller graph-breaks at the call as it would at torch's; called from eager code (no
    frame-evaluation callback installed, one C call to find out) it calls the method directly, and
    otherwise hands over to torch's wrapper, which runs the method with dynamo off.
    """
    if _set_eval_frame is None or _skip_code is None:
        return cast(T, torch.compiler.disable(method))  # type: ignore[arg-type]
    plain = cast(Callable[..., Any], method)
    # torch's wrapper imports torch._dynamo: made at the first call from compiled code, where
    # dynamo is loaded already (only it installs a frame-evaluation callback)
    disabled: list[Any] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if in_eager_code():  # nothing to turn off
            return plain(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(plain))
        return disabled[0](*args, **kwargs)

    functools.update_wrapper(call, plain)
    return cast(T, _skipped_by_dynamo(call, plain))


def eager_entry(method: T) -> T:
    """Mark ``method`` as :func:`eager` does, without a wrapper: the method itself must run its
    own work only when :func:`in_eager_code` says so, and hand over to an :func:`eager` method
    otherwise. For ``Tap.step``, whose short path is a few microseconds: a wrapper forwarding
    ``*args, **kwargs`` costs a tenth of that."""
    if _set_eval_frame is None or _skip_code is None:
        return method  # in_eager_code() is then always False: every call takes the eager method
    return cast(T, _skipped_by_dynamo(method, method))


def _skipped_by_dynamo(function: Any, plain: Any) -> Any:
    """Mark ``function`` as torch's ``disable`` marks its wrapper: a compiled caller graph-breaks
    at the call and runs it natively; dynamo then must not try to compile its frame either."""
    assert _skip_code is not None
    _skip_code(function.__code__)
    for name in ("_torchdynamo_disable", "_torchdynamo_disable_recursive"):
        setattr(function, name, True)
    function._torchdynamo_orig_callable = plain
    return function


def in_eager_code() -> bool:
    """No frame-evaluation callback is installed: the caller is plain eager code (one C call to
    find out). False under a compiled caller, and where torch has no such switch."""
    if _set_eval_frame is None:
        return False
    prior = _set_eval_frame(None)
    if prior is None:
        return True
    _set_eval_frame(prior)
    return False
