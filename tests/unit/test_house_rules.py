"""The house's size limits and the worker API's public names, checked rather than hoped for.

- no module in src/ over 500 lines;
- `Run` under 300 lines;
- no class with more than 25 methods, counting those it inherits from the project's own bases;
- `Run`'s public names are pinned: a name removed breaks users' scripts, a name added is a
  promise (README, docs/engine.md), so either needs this list changed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import unbroken
from unbroken.runtime.run import Run

SRC = Path(unbroken.__file__).parent
MAX_MODULE_LINES = 500
MAX_RUN_LINES = 300
MAX_METHODS = 25

RUN_PUBLIC = {
    # what `unbroken.init()` was given, and where the worker stands
    "config", "env", "events", "backend", "seed", "timeout", "local_rank", "attempt",
    "rank", "world_size", "step", "gen", "slot", "wid", "spare", "joining", "in_place",
    # the API
    "track", "state_dict", "save_checkpoint", "skip_steps", "log", "phase", "steps", "try_step",
    "train", "close",
    "engine",
}


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(SRC)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these modules (lines): {long}"


def _classes() -> dict[str, tuple[set[str], list[str]]]:
    """Every class of the project by name: (its own method names, its bases' names)."""
    found: dict[str, tuple[set[str], list[str]]] = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body
                           if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, ast.Name | ast.Attribute)]
                key = f"{path.relative_to(SRC)}:{node.name}"
                found[key] = (methods, bases)
    return found


def _all_methods(key: str, classes: dict[str, tuple[set[str], list[str]]],
                 by_name: dict[str, str]) -> set[str]:
    methods, bases = classes[key]
    total = set(methods)
    for base in bases:
        if base in by_name and by_name[base] != key:
            total |= _all_methods(by_name[base], classes, by_name)
    return total


def test_no_class_has_more_than_25_methods_with_its_project_bases():
    classes = _classes()
    by_name = {key.split(":")[1]: key for key in classes}
    big = {key: n for key in classes
           if (n := len(_all_methods(key, classes, by_name))) > MAX_METHODS}
    assert big == {}, f"split these classes (methods): {big}"


def test_run_reads_in_one_sitting():
    tree = ast.parse((SRC / "runtime" / "run.py").read_text())
    run, = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run")
    assert run.end_lineno - run.lineno + 1 < MAX_RUN_LINES


def test_the_public_names_of_run_are_pinned():
    names = {n for n in dir(Run) if not n.startswith("_")}
    # Instance attributes set in __init__ (self.x = ...), read from the source.
    tree = ast.parse((SRC / "runtime" / "run.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    for node in ast.walk(init):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self" and isinstance(node.ctx, ast.Store) \
                and not node.attr.startswith("_"):
            names.add(node.attr)
    assert names == RUN_PUBLIC


def test_the_package_exports_and_the_old_module_path_still_work():
    import importlib
    import sys

    import pytest

    sys.modules.pop("unbroken.runtime.session", None)
    with pytest.warns(DeprecationWarning, match="unbroken.runtime.session is deprecated"):
        old = importlib.import_module("unbroken.runtime.session")
    OldRun, old_init = old.Run, old.init  # noqa: N806

    assert unbroken.Run is Run is OldRun and unbroken.init is old_init
    assert set(unbroken.__all__) >= {"Run", "init", "UserError", "ExitCode", "FaultSpec"}
