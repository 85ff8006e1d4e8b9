"""The layering is checked, not hoped for: the import-linter contracts in pyproject.toml hold on
the tree, and a forbidden import breaks the contract that forbids it.

import-linter runs in-process (its `use_cases.lint_imports`, with no cache): it builds the
import graph with grimp from the sources it finds on `sys.path`, without importing them. To show
that a forbidden import fails, a throwaway copy of src/unbroken gets that one import, and the
copy is put first on `sys.path` for the test's duration.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import importlinter.api  # configures import-linter (its readers and graph builder) on import
import pytest
from importlinter.application import use_cases

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = REPO / "pyproject.toml"
CONTRACTS = ("layers", "integrations", "agent", "runtime", "detectors", "launcher", "planner")


def _lint(src: Path, monkeypatch: pytest.MonkeyPatch, contracts: tuple[str, ...]) -> bool:
    """Lint the `unbroken` under `src` against pyproject.toml's contracts (only those named):
    True if every one is kept."""
    monkeypatch.syspath_prepend(str(src))
    # grimp finds the package with importlib.util.find_spec, which answers from sys.modules first.
    monkeypatch.delitem(sys.modules, "unbroken", raising=False)
    spec = importlib.util.find_spec("unbroken")
    assert spec is not None and spec.origin == str(src / "unbroken" / "__init__.py"), spec
    return use_cases.lint_imports(
        config_filename=str(PYPROJECT), limit_to_contracts=contracts, cache_dir=None, no_logo=True)


def test_the_contracts_hold_on_the_tree(monkeypatch):
    assert _lint(REPO / "src", monkeypatch, CONTRACTS)


def test_each_contract_is_declared_in_pyproject():
    declared = {c["id"] for c in importlinter.api.read_configuration(str(PYPROJECT))[
        "contracts_options"]}
    assert declared == set(CONTRACTS)


def _copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of src/unbroken whose `module` (a path under unbroken/) has `line` added."""
    shutil.copytree(REPO / "src" / "unbroken", tmp_path / "unbroken",
                    ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "unbroken" / module
    before = path.read_text() if path.exists() else '"""A module of the throwaway copy."""\n'
    path.write_text(before + f"\n{line}\n")
    return tmp_path


FORBIDDEN = [
    pytest.param("control/__init__.py", "import unbroken.launch.agent", "layers",
                 id="an arrow up: control imports the agent"),
    pytest.param("k8s/names.py", "from unbroken import demo", "layers",
                 id="independent siblings: k8s imports demo"),
    pytest.param("newpackage.py", "import unbroken.errors", "layers",
                 id="a module that no layer names"),
    pytest.param("integrations/trainer.py", "from unbroken.runtime.generations import membership",
                 "integrations", id="an integration imports a private runtime module"),
    pytest.param("launch/drain.py", "from unbroken.runtime.engine import Engine", "agent",
                 id="the agent imports the worker runtime"),
    pytest.param("runtime/groups/world.py", "from unbroken.runtime import engine", "runtime",
                 id="an arrow up inside the runtime: the groups import the engine"),
    pytest.param("runtime/anomalies/numerics.py",
                 "from unbroken.runtime.generations import recovery", "detectors",
                 id="a detector imports the switch between generations"),
    pytest.param("launch/planning/culprit.py", "from unbroken.launch import log_spec",
                 "launcher", id="an arrow up inside the launcher: the planner imports the log flags"),
    pytest.param("launch/planning/budget.py", "from unbroken.control import etcd", "planner",
                 id="the planner imports a backend that does I/O"),
]


@pytest.mark.parametrize("module, line, broken", FORBIDDEN)
def test_a_forbidden_import_breaks_its_contract(tmp_path, monkeypatch, module, line, broken):
    src = _copy_with(tmp_path, module, line)
    assert not _lint(src, monkeypatch, (broken,))
    assert _lint(src, monkeypatch, tuple(c for c in CONTRACTS if c != broken))


def test_an_integration_may_import_the_engines_public_modules(tmp_path, monkeypatch):
    lines = "\n".join([
        "from unbroken.runtime import engine",
        "from unbroken.runtime.run import Run",
        "import unbroken.runtime.position",
        "from unbroken import telemetry",
    ])
    src = _copy_with(tmp_path, "integrations/trainer.py", lines)
    assert _lint(src, monkeypatch, CONTRACTS)
