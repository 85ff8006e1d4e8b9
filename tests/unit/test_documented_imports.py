"""Every import path the user documentation names still resolves: a module moved into a
sub-package keeps its documented path (through a re-export for one release), and a doc that
names a path that no longer exists fails here, not in a user's script."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "examples").rglob("*.py"))]
_DOTTED = re.compile(r"\bunbroken(?:\.[A-Za-z_]\w*)+")
_FROM = re.compile(r"^\s*from (unbroken(?:\.\w+)*) import ([\w, ]+)", re.M)


def documented_paths() -> list[str]:
    """`unbroken.a.b[.Name]` and `from unbroken.a import b, c`, as the docs write them."""
    found: set[str] = set()
    for doc in DOCS:
        text = doc.read_text()
        found.update(m.rstrip(".") for m in _DOTTED.findall(text))
        for module, names in _FROM.findall(text):
            found.update(f"{module}.{n.split(' as ')[0].strip()}" for n in names.split(",")
                         if n.strip())
    return sorted(found)


def resolve(path: str) -> object:
    """The module the longest importable prefix of `path` names, and the attributes after it."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not path.startswith(exc.name):
                raise  # a module that exists failed to import: a real error
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def test_the_docs_name_import_paths():
    paths = documented_paths()
    assert "unbroken.runtime.engine" in paths and "unbroken.integrations.hf" in paths, paths


@pytest.mark.parametrize("path", documented_paths())
def test_each_documented_path_resolves(path):
    assert resolve(path) is not None


def _project_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) for every `from unbroken... import name` in the project's code,
    inside functions too (a lazy import fails only when its function first runs)."""
    import ast

    found = []
    for root in ("src", "benchmarks", "examples", "tests"):
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] == "unbroken":
                    found += [(str(path.relative_to(REPO)), node.module, a.name)
                              for a in node.names if a.name != "*"]
    return found


def test_every_import_of_the_project_names_what_exists():
    """Each `from unbroken.x import y` names a module or an attribute that exists (a module
    moved into a sub-package once left a lazy import behind that only a run found)."""
    missing = []
    for where, module, name in _project_imports():
        try:
            resolve(f"{module}.{name}")
        except (ImportError, AttributeError) as exc:
            missing.append(f"{where}: from {module} import {name} ({exc})")
    assert not missing, "\n".join(missing)
