"""A Keras model's outputs (heads) and how the targets match them: backend-neutral, no TensorFlow.

Both recorders name per-output values after the model's outputs (``loss/<head>``,
``accuracy/<head>``) and pair each output with its targets the way Keras' compiled loss does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["compiled_losses", "head_pair", "like", "model_heads", "resolve", "single"]


def model_heads(model: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The model's output (head) names, and the heads that get an accuracy (class scores: last
    dimension > 1, or not known). Known before tracing for Sequential and functional models; a
    subclassed model's outputs are known only when traced: it counts as one head."""
    try:
        names = tuple(str(n) for n in model.output_names)
        dims = tuple(t.shape[-1] for t in model.outputs)
    except (AttributeError, TypeError, ValueError, IndexError):
        names, dims = (), ()
    if len(names) != len(dims) or len(set(names)) != len(names):
        names, dims = (), ()
    if len(names) <= 1:
        classes = dims[0] if dims else None
        return ("output",), ("output",) if classes is None or classes > 1 else ()
    return names, tuple(n for n, d in zip(names, dims) if d is None or d > 1)


def compiled_losses(model: Any) -> list[Any]:
    """Keras' compiled losses per output, ``(path, loss, loss_weight, name)``: built by the first
    ``compute_loss`` of the trace (a private attribute of Keras' ``CompileLoss``, read on purpose:
    it is what Keras itself sums into the total loss)."""
    compiled = vars(model).get("_compile_loss")
    return [f for f in (getattr(compiled, "_flat_losses", None) or []) if getattr(f, "loss", None) is not None]


def resolve(path: Sequence[Any], value: Any) -> Any:
    """``value[path[0]][path[1]]...``."""
    for key in path:
        value = value[key]
    return value


def single(keras: Any, y: Any) -> Any:
    """The one target tensor of a single-output model's ``y``, else None."""
    flat = keras.tree.flatten(y) if y is not None else []
    return flat[0] if len(flat) == 1 else None


def like(keras: Any, y: Any, y_pred: Any, model: Any) -> Any:
    """``y`` in ``y_pred``'s structure, the way Keras' compiled loss matches them."""
    try:
        keras.tree.assert_same_structure(y_pred, y)
        return y
    except (ValueError, TypeError):
        pass
    if isinstance(y_pred, (list, tuple)) and isinstance(y, dict):
        names = list(getattr(model, "output_names", []) or [])
        if set(names) == set(y):
            return type(y_pred)(y[name] for name in names)
    if isinstance(y_pred, dict) and isinstance(y, (list, tuple)):
        names = [n for n in (getattr(model, "output_names", []) or []) if n in y_pred]
        if len(names) == len(y):
            return dict(zip(names, y))
    return keras.tree.pack_sequence_as(y_pred, keras.tree.flatten(y))


def head_pair(keras: Any, head: str, heads: Sequence[str], y: Any, y_pred: Any) -> tuple[Any, Any]:
    """The targets and the output of ``head`` (``y`` already in ``y_pred``'s structure): by name
    in a dict, else by the head's place among the model's outputs."""
    try:
        return resolve((head,), y), resolve((head,), y_pred)
    except (KeyError, TypeError, IndexError):
        index = list(heads).index(head)
        return keras.tree.flatten(y)[index], keras.tree.flatten(y_pred)[index]
