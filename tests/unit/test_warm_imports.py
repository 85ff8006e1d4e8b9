"""Warm interpreters pre-import what the previous attempt's workers imported (installed
packages and the standard library only), so that a plain script's restart skips its own
imports. (Their events: `warm_imports`, `warm_taken`.)"""

from __future__ import annotations

import json
import sys

from unbroken.runtime.warm_imports import MODULES_FILE, ImportRecorder, modules_path


def test_the_list_names_installed_modules_only(tmp_path, monkeypatch):
    (tmp_path / "warm_local_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "warm_local_mod", raising=False)
    import networkx  # noqa: F401
    import warm_local_mod  # noqa: F401

    path = tmp_path / "run" / "node_0" / MODULES_FILE
    assert modules_path(tmp_path / "run", 0) == path
    recorder = ImportRecorder(path, script_dir=str(tmp_path))
    assert recorder.record()
    names = json.loads(path.read_text())["modules"]
    assert "networkx" in names and "json" in names
    assert "warm_local_mod" not in names and "__main__" not in names
    assert not any(n.startswith(("unbroken", "conftest")) for n in names)  # not installed here
    assert not recorder.record()  # nothing new: not rewritten
    monkeypatch.delitem(sys.modules, "warm_local_mod")


def test_a_module_whose_import_is_an_action_is_never_a_valid_name():
    from unbroken.runtime.warm_imports import valid_name

    assert valid_name("json.decoder") and valid_name("networkx")
    for name in ("unittest.__main__", "__main__", "antigravity", "this", "a..b", "", 7):
        assert not valid_name(name), name


def test_caught_up_reads_the_list_again_so_a_report_covers_the_list_as_it_is_now(tmp_path):
    """The fork server reports after `caught_up()`: a name added to the file after the last
    look is queued by it, and the report waits until that name is dealt with too."""
    from unbroken.runtime.warm_imports import Preimporter

    path = tmp_path / MODULES_FILE
    path.write_text(json.dumps({"modules": ["json", "json.decoder"]}))
    pre = Preimporter(path)
    assert pre.refresh() and pre.pending == 2
    while pre.pending:
        pre.step()  # both already imported here: skipped without a probe
    assert pre.caught_up() and pre.listed == 2
    reported = pre.tally()
    path.write_text(json.dumps({"modules": ["json", "json.decoder", "json.scanner",
                                            "not a name"]}))
    assert not pre.caught_up() and pre.pending == 1 and pre.listed == 3
    pre.step()
    assert pre.caught_up() and pre.tally() != reported  # the list grew: a new report is due
