"""The loss of a ``backward()`` call, read from the autograd graph (never from values).

A loop hands ``backward()`` a tensor that is often not the loss it reports: nanoGPT divides it by
the accumulation count (``(loss / accum).backward()``), the AMP recipe multiplies it by the
``GradScaler``'s scale (``scaler.scale(loss).backward()``), Accelerate and Lightning divide by
their accumulation steps. Each of these is a ``Mul``/``Div`` node by a constant (an operand that
needs no gradient) between the tensor and the loss function's own node. :func:`resolve` walks
those nodes down to a recorded loss-function call (:class:`LossCall`) and takes that call's
output; where no recorded call sits under the constants, it undoes them on the device
(``t / scale``, ``t * 4``) and says what it assumed.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["LossCall", "Resolved", "resolve"]

# a constant factor: the node multiplies or divides the loss by an operand that needs no gradient
_MUL, _DIV = "MulBackward0", "DivBackward0"
# nodes that change nothing but the dtype or the view of a 0-dim loss
_THROUGH = frozenset({"ToCopyBackward0", "ViewBackward0", "SqueezeBackward0", "CloneBackward0"})
_DDP_SINK = "_DDPSinkBackward"
_MAX_NODES = 16


@dataclasses.dataclass(slots=True)
class LossCall:
    """One call of a recognised loss function whose 0-dim output needs a gradient.

    Attributes:
        output: the function's output (the loss before any division or scaling).
        logits: the class scores it saw, when the call is a classification (integer class
            targets): what accuracy is counted from.
        targets: the class indices it saw (with ``logits``).
        ignore_index: the targets' value the loss leaves out.
        reduction: ``"mean"`` or ``"sum"`` (a summed loss is divided by its kept targets).
        samples: the samples of the batch (docs/loops.md, "Throughput"): the leading dimension of
            the tensor the loop flattened into the logits' rows (``(B, T, V) -> (B*T, V)``: B
            sequences), else the logits' rows; 0 without logits. Shape metadata only.
        tokens: the batch's tokens where its framework tells them (the HF Trainer's causal LM: the
            ``input_ids`` of the running ``training_step``, as ``BatchtapTrainer`` counts), else None.
    """

    output: torch.Tensor
    logits: torch.Tensor | None
    targets: torch.Tensor | None
    ignore_index: int
    reduction: str
    samples: int = 0
    tokens: int | None = None


@dataclasses.dataclass(slots=True)
class Resolved:
    """What :func:`resolve` found for one ``backward()`` tensor.

    Attributes:
        loss: 0-dim, detached, on the tensor's device: the loss with the constants undone.
        call: the recorded loss call under the constants, if one was found.
        undone: what was undone, in words (``"x GradScaler scale"``, ``"/ constant"``), root first.
        scale: the GradScaler scale the tensor was multiplied by, when it was (a device tensor).
        divided: a constant factor other than the GradScaler scale was undone (an accumulation
            count, a loss weight). A factor of exactly 1 (``(loss * 1).backward()``, the HF
            Trainer's ``loss *= num_processes`` on one process) is no factor: nothing is undone.
        normalised: a ``reduction="sum"`` loss divided by a count the loop computed (the HF
            Trainer's causal-LM ``CE(sum) / num_items_in_batch``, a tensor normalising over the
            whole optimizer step): ``loss`` is then what ``backward()`` got (scale undone), and the
            step's loss is the sum over its micro-batches, ``sum(CE) / N``.
        factors: each constant factor but the scale as a multiplier, None where only the device
            knows it: micro-batches of one accumulation carry equal factors, weighted losses not.
        shape: the graph's node names from the tensor down to the loss's own node: micro-batches
            of one accumulated loss have the same shape, different losses rarely do.
    """

    loss: torch.Tensor
    call: LossCall | None
    undone: tuple[str, ...]
    scale: torch.Tensor | None = None
    divided: bool = False
    shape: tuple[str, ...] = ()
    normalised: bool = False
    factors: tuple[float | None, ...] = ()


def resolve(tensor: torch.Tensor, calls: Mapping[Any, LossCall], scale: torch.Tensor | None = None) -> Resolved:
    """The loss behind ``tensor`` (what was given to ``backward()``). No host read.

    Args:
        tensor: the 0-dim tensor given to ``backward()``.
        calls: recorded loss calls, keyed by their output's ``grad_fn``.
        scale: the ``GradScaler``'s scale tensor, to name it when it is undone.

    Example:
        >>> logits = torch.randn(4, 3, requires_grad=True); y = torch.tensor([0, 1, 2, 1])
        >>> loss = torch.nn.functional.cross_entropy(logits, y)
        >>> call = LossCall(loss, logits, y, -100, "mean")
        >>> found = resolve(loss / 4, {loss.grad_fn: call})
        >>> found.call is call, found.loss is loss, found.undone
        (True, False, ('/ constant',))
        >>> torch.equal(found.loss, loss.detach())
        True
        >>> resolve((loss * 2.0) * 8.0, {}).undone  # no recorded call: the constants undone on the device
        ('x constant', 'x constant')
    """
    node = tensor.grad_fn
    factors: list[tuple[str, Any, float | None]] = []  # (op, constant, its host value) from the root down
    names: list[str] = []
    edge = 0  # which output of ``node`` the walk came down through (DDP's sink has one per model output)
    for _ in range(_MAX_NODES):
        if node is None:
            break
        name = node.name()
        names.append(name)
        call = calls.get(node)
        if call is not None:
            value = call.output.detach() if call.reduction != "sum" else _value_of(call)
            return _resolved(value, call, factors, scale, names, tensor)
        following = node.next_functions
        if name in _THROUGH and following:
            node, edge = following[0]
            continue
        if name == _DDP_SINK and edge < len(following):
            # DistributedDataParallel passes the model's outputs through one node (its _DDPSink): output k
            # of it is input k, the model's own loss below it
            node, edge = following[edge]
            continue
        if name not in (_MUL, _DIV) or len(following) != 2:
            break
        (first, _), (second, _) = following
        if second is None and first is not None:  # loss (*|/) constant
            constant, node, edge = node._saved_other, first, following[0][1]  # type: ignore[attr-defined]
        elif name == _MUL and first is None and second is not None:  # constant * loss
            constant, node, edge = node._saved_self, second, following[1][1]  # type: ignore[attr-defined]
        else:  # both sides need gradients, or a constant divided by the loss: not a constant factor
            break
        number = host_number(constant)  # read once: both "is it 1" and the factor's value
        if number != 1:  # x 1 changes nothing: (loss * 1).backward() is loss.backward()
            factors.append((name, constant, number))
    value = tensor.detach()
    for op, constant, _ in reversed(factors):  # innermost factor last applied: undo from the root down
        value = value / constant if op == _MUL else value * constant
    return _resolved(value, None, factors, scale, names, tensor)


def _resolved(
    value: torch.Tensor,
    call: LossCall | None,
    factors: list[tuple[str, Any, float | None]],
    scale: torch.Tensor | None,
    names: list[str],
    root: torch.Tensor,
) -> Resolved:
    # one pass over the factors (this runs at every backward(): no generator per field)
    if not factors:  # loss.backward() itself (or through x 1): nothing undone
        return Resolved(value, call, (), None, False, tuple(names))
    undone: list[str] = []
    kept: list[float | None] = []  # the factors but the scale, as multipliers
    scaled = divides = False
    for op, constant, number in factors:
        if scale is not None and _is_scale(constant, scale):
            undone.append(_WORDS[op, True])
            scaled = True
        else:
            undone.append(_WORDS[op, False])
            kept.append(number if op == _MUL else (None if number is None or number == 0 else 1.0 / number))
            divides = divides or op == _DIV
    normalised = divides and call is not None and call.reduction == "sum"
    if normalised:  # what backward() got, the scale undone: sums to sum(CE) / N over the step
        value = root.detach()
        for op, constant, _ in factors:
            if scale is not None and _is_scale(constant, scale):
                value = value / constant if op == _MUL else value * constant
    # positional, in Resolved's field order: loss, call, undone, scale, divided, shape, normalised, factors
    return Resolved(
        value, call, tuple(undone), scale if scaled else None, bool(kept), tuple(names), normalised, tuple(kept)
    )


#: dtypes of the 0-dim CPU tensors a Python number becomes in an op, and the ctypes type their bytes read as
_SCALAR_TYPES: dict[torch.dtype, Any] = {
    torch.int64: ctypes.c_int64,
    torch.float64: ctypes.c_double,
    torch.float32: ctypes.c_float,
    torch.int32: ctypes.c_int32,
}


def host_number(constant: Any) -> float | None:
    """A constant factor's value when it is known without a device read: a Python number, or a
    0-dim CPU tensor (what a Python number in ``loss * 1`` becomes) read from its host bytes, not
    through an op (it is host memory: no device is involved, on a GPU run as on the CPU). A device
    tensor is never read: None, whatever its value.

    Called at every ``backward()`` (once per constant factor): kept to attribute reads and one
    ``ctypes`` load (``from_address``, no foreign-function call and no ``torch.device`` made).
    """
    if isinstance(constant, (int, float)):
        return float(constant)
    if not isinstance(constant, torch.Tensor) or not constant.is_cpu or constant.dim() != 0:
        return None
    kind = _SCALAR_TYPES.get(constant.dtype)
    if kind is None:
        return None
    try:
        # its bytes straight from host memory: an op (item, indexing the storage) would go through
        # the dispatcher, which is what a device read looks like
        address = constant.data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without host bytes (a fake or lazy one): not known
        return None
    if not address:
        return None
    return float(kind.from_address(address).value)


def _is_scale(constant: Any, scale: torch.Tensor | None) -> bool:
    return scale is not None and isinstance(constant, torch.Tensor) and constant.data_ptr() == scale.data_ptr()


def _value_of(call: LossCall) -> torch.Tensor:
    """The call's loss as a mean: a ``reduction="sum"`` loss (Hugging Face's causal LM loss sums,
    then divides by the batch's token count itself) is divided by its kept targets, on the device."""
    loss = call.output.detach()
    if call.reduction == "sum" and call.targets is not None:
        kept = call.targets.ne(call.ignore_index).sum()
        return loss / kept.clamp_min(1)
    return loss


#: what undoing a factor is called, by (node, whether the factor is the GradScaler scale)
_WORDS = {
    (_MUL, True): "x GradScaler scale",
    (_DIV, True): "/ GradScaler scale",
    (_MUL, False): "x constant",
    (_DIV, False): "/ constant",
}
