"""A package's names imported on first use (PEP 562): the ``__getattr__`` and ``__dir__`` of every
package that defers its imports, written once.

Deferring keeps ``import batchtap`` and the torch-free commands cheap, and lets a pipeline process
load only the parts it is handed.

Example:
    >>> namespace = {"__all__": ["JSONDecoder"]}
    >>> getattr_, dir_ = lazy_exports("json", {"JSONDecoder": "decoder"}, namespace, modules=("encoder",))
    >>> getattr_("JSONDecoder").__module__, "JSONDecoder" in namespace
    ('json.decoder', True)
    >>> getattr_("encoder").__name__
    'json.encoder'
    >>> dir_()
    ['JSONDecoder', '__all__', 'encoder']
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, where: Mapping[str, str], namespace: dict[str, Any], *, modules: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's dotted name (in messages and for its submodules).
        where: public name -> the module that defines it (a full dotted name, or a module of the
            package by its own name).
        namespace: the package's ``globals()``: a name once loaded is kept there, so later
            lookups skip ``__getattr__``.
        modules: names that are submodules of the package, given as the modules themselves.
    """
    submodules = frozenset(modules)

    def __getattr__(name: str) -> Any:
        if name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            module = where.get(name)
            if module is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(module if "." in module else f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where) | submodules | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
