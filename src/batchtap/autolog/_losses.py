"""Recording the calls of the classification losses: what accuracy is counted from.

``F.cross_entropy`` and ``F.nll_loss`` are replaced by wrappers that call the original and, when
the output is a 0-dim loss that needs a gradient (a training loss, not an evaluation under
``no_grad``), remember the call keyed by the output's ``grad_fn``. ``nn.CrossEntropyLoss`` and
``nn.NLLLoss`` call the functions through the ``torch.nn.functional`` module, so they are seen too.
A name bound before autolog (``from torch.nn.functional import cross_entropy`` at import time)
keeps the original: such a loop gets its loss from the graph but no accuracy (said once).

Inside ``torch.compile`` the wrappers run only while tracing: they record nothing there.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from batchtap.autolog._graph import LossCall
from batchtap.autolog._patches import PatchRegistry
from batchtap.autolog._trainers import trainer_tokens

__all__ = ["LossCalls"]

#: the loss functions patched; both take (input, target, weight, size_average, ignore_index, reduce, reduction)
_FUNCTIONS = ("cross_entropy", "nll_loss")
_IGNORE_AT, _REDUCTION_AT = 4, 6
_KEPT = 16  # calls remembered without a backward() (a loop computing losses it never trains on)


class LossCalls:
    """The recorded loss calls since the last ``backward()``.

    Attributes:
        by_node: output ``grad_fn`` -> :class:`~batchtap.autolog._graph.LossCall`, oldest first.
        seen: whether any recognised loss function was called with a gradient at all.
    """

    def __init__(self) -> None:
        self.by_node: collections.OrderedDict[Any, LossCall] = collections.OrderedDict()
        self.seen = False

    def install(self, patches: PatchRegistry) -> None:
        """Replace the loss functions of ``torch.nn.functional`` with recording wrappers."""
        for name in _FUNCTIONS:
            original = getattr(F, name)
            patches.replace(F, name, self._wrap(original))

    def last_classification(self) -> LossCall | None:
        """The most recent recorded call that saw logits and class targets."""
        for call in reversed(self.by_node.values()):
            if call.logits is not None:
                return call
        return None

    def clear(self) -> None:
        self.by_node.clear()

    def _wrap(self, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        record = self._record
        is_compiling = torch.compiler.is_compiling

        def loss_function(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = original(*args, **kwargs)
            node = out.grad_fn
            if node is not None and not is_compiling():
                record(out, node, args, kwargs)
            return out

        loss_function.__name__ = original.__name__
        loss_function.__qualname__ = original.__qualname__
        loss_function.__doc__ = original.__doc__
        loss_function.__wrapped__ = original  # type: ignore[attr-defined]
        return loss_function

    def _record(self, out: torch.Tensor, node: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # runs at every training loss call: plain reads, no helper calls
        if out.dim() != 0:
            return  # reduction="none": the loop reduces it itself; the graph walk sees its own nodes
        n = len(args)
        if kwargs:
            logits = args[0] if n else kwargs.get("input")
            targets = args[1] if n > 1 else kwargs.get("target")
            ignore = args[_IGNORE_AT] if n > _IGNORE_AT else kwargs.get("ignore_index", -100)
            reduction = args[_REDUCTION_AT] if n > _REDUCTION_AT else kwargs.get("reduction", "mean")
        else:  # the usual F.cross_entropy(logits, targets)
            logits = args[0] if n else None
            targets = args[1] if n > 1 else None
            ignore = args[_IGNORE_AT] if n > _IGNORE_AT else -100
            reduction = args[_REDUCTION_AT] if n > _REDUCTION_AT else "mean"
        if type(ignore) is not int:
            ignore = int(ignore) if isinstance(ignore, int) else -100
        if type(reduction) is not str:
            reduction = str(reduction)
        if (
            isinstance(logits, torch.Tensor)
            and isinstance(targets, torch.Tensor)
            and logits.dim() >= 2
            and not targets.is_floating_point()
            and not targets.is_complex()
        ):  # a classification: what accuracy is counted from
            tokens = trainer_tokens()  # read now: the Trainer's training_step drops its inputs before backward()
            call = LossCall(out, logits.detach(), targets, ignore, reduction, _samples(logits, targets), tokens)
        else:
            call = LossCall(out, None, None, ignore, reduction)
        by_node = self.by_node
        by_node[node] = call
        if len(by_node) > _KEPT:
            by_node.popitem(last=False)
        self.seen = True


def _samples(logits: torch.Tensor, targets: torch.Tensor) -> int:
    """The samples of a classification call (shape metadata, no host read): where the loop flattened
    a sequence batch for the loss (``logits.view(-1, V)``, ``targets.view(-1)``), the leading dimension
    of the tensor it flattened (the sequences, as the explicit API counts them), else the logits' rows.

    A flattening is a view whose base has more dimensions and as many elements: read before the
    logits are detached (a detached view has no base). A loop that copies instead (``.reshape`` of a
    non-contiguous tensor) and whose targets are no view either is counted by the rows.
    """
    rows = logits.shape[0]
    base = logits._base
    if base is not None and logits.dim() == 2 and base.dim() > 2 and base.shape[-1] == logits.shape[1]:
        if base.numel() == logits.numel():
            return int(base.shape[0])
    base = targets._base
    if base is not None and targets.dim() == 1 and base.dim() > 1 and base.numel() == rows:
        return int(base.shape[0])
    return int(rows)
