"""`when_imported`: a callback runs right after a module's first import, or at once."""

from __future__ import annotations

import importlib
import sys

from unbroken.import_hooks import when_imported


def _module(tmp_path, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)


def test_the_callback_runs_after_the_module_and_before_the_importer_sees_it(tmp_path, monkeypatch):
    _module(tmp_path, "ub_hooked_a", "value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def patch(module):
        seen.append(module.value)
        module.value = 2

    when_imported("ub_hooked_a", patch)
    try:
        assert seen == []  # nothing imported by the hook itself
        module = importlib.import_module("ub_hooked_a")
        assert seen == [1] and module.value == 2
        importlib.reload(module)  # once: a reload is not a first import
        assert seen == [1]
        assert module.__spec__.loader.__class__.__name__ != "_Loader"  # its real loader
    finally:
        sys.modules.pop("ub_hooked_a", None)


def test_a_module_already_imported_gets_the_callback_at_once():
    got = []
    when_imported("json", got.append)
    assert got == [sys.modules["json"]]


def test_an_unwatched_import_is_not_touched(tmp_path, monkeypatch):
    _module(tmp_path, "ub_hooked_b", "value = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    when_imported("ub_hooked_never", lambda m: None)
    try:
        assert importlib.import_module("ub_hooked_b").value == 3
    finally:
        sys.modules.pop("ub_hooked_b", None)


def test_a_finder_that_imports_the_module_itself_meanwhile_breaks_nothing(tmp_path, monkeypatch):
    """Another meta-path finder (an import hook of the user's) asked for the watched name
    imports it re-entrantly: the callbacks run once, in that import, and the outer find
    does not fail (it raised KeyError before)."""
    import importlib.abc

    _module(tmp_path, "ub_hooked_b", "value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("ub_hooked_b", lambda module: seen.append(module.value))

    class Eager(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "ub_hooked_b" and self in sys.meta_path:
                sys.meta_path.remove(self)
                importlib.import_module(name)
            return None

    eager = Eager()
    sys.meta_path.insert(1, eager)
    try:
        assert importlib.import_module("ub_hooked_b").value == 1
        assert seen == [1]
    finally:
        if eager in sys.meta_path:
            sys.meta_path.remove(eager)
        sys.modules.pop("ub_hooked_b", None)


def test_a_spec_only_looked_at_keeps_the_callbacks_for_the_real_import(tmp_path, monkeypatch):
    """`importlib.util.find_spec` (the fork server's preimporter checks a name with it before
    importing) must not use up the callbacks: they run when the module is executed."""
    import importlib.util
    import sys

    from unbroken.import_hooks import when_imported

    (tmp_path / "looked_at_first.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "looked_at_first", raising=False)
    seen = []
    when_imported("looked_at_first", lambda m: seen.append(m.X))
    assert importlib.util.find_spec("looked_at_first") is not None and seen == []
    import looked_at_first  # noqa: F401

    assert seen == [1]
    monkeypatch.delitem(sys.modules, "looked_at_first")
