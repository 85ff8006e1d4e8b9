"""Run a function right after a module is first imported, without importing it ourselves.

The worker's bootstrap uses it to adapt what a script imports (`torch.distributed`, the
Hugging Face `Trainer`, Lightning) only if and when the script imports it: a script that
never imports a framework pays nothing for its integration.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once `name` has been imported and executed: at once if it
    already is, else right after its import (before the importer sees it). A callback that
    raises makes that import raise: callbacks must be safe."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _FINDER.callbacks.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a watched name it asks the other finders, and wraps the
    spec's loader so that the callbacks run after the module's code."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                # The callbacks are taken when the module is executed, not here: a spec may
                # only be looked at (`importlib.util.find_spec`) and never loaded.
                spec.loader = _Loader(spec.loader, self, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, finder: _AfterImport, name: str) -> None:
        self.inner, self.finder, self.name = inner, finder, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module's own machinery (e.g. `importlib.resources`) must see its real loader.
        module.__spec__.loader = module.__loader__ = self.inner
        self.inner.exec_module(module)
        for callback in self.finder.callbacks.pop(self.name, ()):
            callback(module)


_FINDER = _AfterImport()
