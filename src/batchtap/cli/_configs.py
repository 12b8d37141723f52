"""The config of a script run by ``batchtap run`` when it is a Hydra or OmegaConf one.

``argparse`` scripts are read by :class:`batchtap.cli.run.ParsedArguments`. A Hydra script
(``@hydra.main``) gets its resolved config as the task function's argument: the wrapper here hands
it over, flattened to dotted keys (``optimizer.lr``), before the task runs. A script that builds
its config with OmegaConf from the command line (``OmegaConf.from_cli()``, usually merged into a
base config) has the result of that merge taken (or the command-line config alone when nothing
merges it).

Neither library is imported here: the hooks are installed when the script imports them (an import
finder patches the module right after it has loaded), so a script without them pays nothing and
batchtap needs neither.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__all__ = ["ConfigHooks", "flatten"]


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys: ``{"opt": {"lr": 0.1}}`` -> ``{"opt.lr": 0.1}``.
    Lists and scalars are kept as values; an empty mapping is kept under its own key."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after one of the named top-level modules has been executed
    (before the importer sees it), by wrapping the loader that the other finders return."""

    def __init__(self, patches: Mapping[str, Callable[[ModuleType], None]]) -> None:
        self._patches = dict(patches)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = self._patches.pop(fullname, None)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module: ModuleType, run: Any = run, patch: Any = patch) -> None:
                    run(module)
                    patch(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


class ConfigHooks:
    """While installed, hands each Hydra / OmegaConf config of the script to ``on_config``
    (a flat ``{dotted key: value}`` dict); every patch is undone on exit.

    Args:
        on_config: called with the config; an error in it is the caller's to keep quiet.
    """

    def __init__(self, on_config: Callable[[dict[str, Any]], None]) -> None:
        self._on_config = on_config
        self._undo: list[Callable[[], None]] = []
        self._finder: _AfterImport | None = None

    def __enter__(self) -> ConfigHooks:
        patches = {"hydra": self._patch_hydra, "omegaconf": self._patch_omegaconf}
        for name in list(patches):
            if name in sys.modules:  # imported before the script ran (by another tool): patch it now
                patches.pop(name)(sys.modules[name])
        self._finder = _AfterImport(patches)
        sys.meta_path.insert(0, self._finder)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        while self._undo:
            self._undo.pop()()

    def _hand_over(self, config: Any) -> None:
        """``config`` resolved and flattened to ``on_config``; recording it never breaks the script."""
        try:
            from omegaconf import OmegaConf

            values = OmegaConf.to_container(config, resolve=True)
            if isinstance(values, Mapping):
                self._on_config(flatten({str(k): v for k, v in values.items()}))
        except Exception as exc:  # noqa: BLE001 - an unresolvable interpolation, a store down: the script goes on
            print(f"batchtap: note: the script's config was not stored: {exc}", file=sys.stderr)

    def _patch_hydra(self, hydra: ModuleType) -> None:
        original = hydra.main
        hand_over = self._hand_over

        @functools.wraps(original)
        def main(*args: Any, **kwargs: Any) -> Any:
            decorate = original(*args, **kwargs)

            def decorator(task: Callable[..., Any]) -> Any:
                # functools.wraps keeps __wrapped__: Hydra finds the script's folder through it
                @functools.wraps(task)
                def recorded(cfg: Any, *rest: Any, **more: Any) -> Any:
                    hand_over(cfg)
                    return task(cfg, *rest, **more)

                return decorate(recorded)

            return decorator

        hydra.main = main  # type: ignore[attr-defined]
        self._undo.append(lambda: setattr(hydra, "main", original))

    def _patch_omegaconf(self, omegaconf: ModuleType) -> None:
        cls = omegaconf.OmegaConf
        from_cli, merge = cls.from_cli, cls.merge
        from_command_line: set[int] = set()  # ids of the configs from_cli() made (alive: the script holds them)
        hand_over = self._hand_over

        def recorded_from_cli(*args: Any, **kwargs: Any) -> Any:
            config = from_cli(*args, **kwargs)
            from_command_line.add(id(config))
            hand_over(config)
            return config

        def recorded_merge(*configs: Any, **kwargs: Any) -> Any:
            merged = merge(*configs, **kwargs)
            if any(id(c) in from_command_line for c in configs):
                from_command_line.add(id(merged))  # merged again later (a third layer): still the run's
                hand_over(merged)
            return merged

        cls.from_cli, cls.merge = staticmethod(recorded_from_cli), staticmethod(recorded_merge)

        def undo() -> None:
            cls.from_cli, cls.merge = staticmethod(from_cli), staticmethod(merge)

        self._undo.append(undo)
