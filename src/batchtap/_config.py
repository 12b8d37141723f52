"""Run configs as JSON: the everyday objects people pass as ``config=`` made storable.

``argparse.Namespace``, dataclasses, mappings, sequences, ``pathlib`` paths, enums, ``torch.dtype``
and ``torch.device`` become plain JSON values; non-finite floats become their ``repr`` text (JSON has
no NaN); anything else is stored as its ``repr`` with a warning naming the key, never a raw
``TypeError``.

Example:
    >>> import argparse, pathlib
    >>> to_json_config(argparse.Namespace(lr=3e-4, out=pathlib.Path("ckpt"), tags=("a", "b")))
    ({'lr': 0.0003, 'out': 'ckpt', 'tags': ['a', 'b']}, [])
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["to_json_config"]


def to_json_config(config: object) -> tuple[dict[str, Any], list[str]]:
    """``config`` as a JSON-safe dict, and the keys that had to be stored as ``repr`` text.

    Raises:
        TypeError: ``config`` itself is not a mapping, a Namespace or a dataclass instance.
    """
    if config is None:
        return {}, []
    if isinstance(config, argparse.Namespace):
        config = vars(config)
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config must be a mapping, an argparse.Namespace or a dataclass instance, got "
            f"{type(config).__name__}; e.g. config=vars(args) or config={{'lr': 3e-4}}"
        )
    as_repr: list[str] = []
    out = {str(k): _value(v, str(k), as_repr, 0) for k, v in config.items()}
    return out, as_repr


def _value(v: object, path: str, as_repr: list[str], depth: int) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, enum.Enum):
        return _value(v.value, path, as_repr, depth + 1)
    if isinstance(v, (torch.dtype, torch.device, os.PathLike)):
        return str(v) if not isinstance(v, os.PathLike) else os.fspath(v)
    if depth < 8:
        if isinstance(v, argparse.Namespace):
            v = vars(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            v = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        if isinstance(v, Mapping):
            return {str(k): _value(x, f"{path}.{k}", as_repr, depth + 1) for k, x in v.items()}
        if isinstance(v, (list, tuple, set, frozenset)):
            items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
            return [_value(x, f"{path}[{i}]", as_repr, depth + 1) for i, x in enumerate(items)]
    if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.numel() <= 64:
        # sync: none in fact — a small host tensor in a run's config, read once when the run starts
        return v.tolist()
    as_repr.append(path)
    return repr(v)
