"""Every change autolog makes to other code, in one place that can undo all of it.

Autolog attaches to PyTorch at public seams: optimizer step hooks (handles), and attribute
replacements (``torch.autograd.backward``, the loss functions, ``clip_grad_norm_``,
``GradScaler.step``, ``DataLoader.__iter__``). Each is registered here with what it replaced, so
``undo()`` restores the exact original objects in reverse order, once, whatever happened between.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["PatchRegistry"]

log = logging.getLogger("batchtap")


class PatchRegistry:
    """Attribute replacements and hook handles, undone together.

    Example:
        >>> import types
        >>> owner = types.SimpleNamespace(f=len)
        >>> patches = PatchRegistry()
        >>> original = patches.replace(owner, "f", lambda x: 0)
        >>> owner.f("abc"), patches.active
        (0, True)
        >>> patches.undo(); owner.f("abc"), patches.active
        (3, False)
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    @property
    def active(self) -> bool:
        """Whether anything is patched."""
        return bool(self._undo)

    def replace(self, owner: Any, name: str, new: Any) -> Any:
        """Set ``owner.name = new``; return what was there (undo puts it back)."""
        had_own = name in vars(owner) if hasattr(owner, "__dict__") else True
        original = getattr(owner, name)
        setattr(owner, name, new)

        def restore() -> None:
            if had_own:
                setattr(owner, name, original)
            else:  # the attribute was inherited: remove ours so the inherited one shows again
                delattr(owner, name)

        self._undo.append(restore)
        return original

    def handle(self, handle: Any) -> None:
        """A hook handle with ``remove()`` (optimizer step hooks)."""
        self._undo.append(handle.remove)

    def undo(self) -> None:
        """Restore everything, newest first. Never raises: a failed restore is logged."""
        while self._undo:
            restore = self._undo.pop()
            try:
                restore()
            except Exception:  # noqa: BLE001 - keep restoring the rest
                log.exception("batchtap autolog: undoing a patch failed")
