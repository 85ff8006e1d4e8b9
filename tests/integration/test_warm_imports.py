"""The node's fork server pre-imports what the workers imported (installed packages and the
standard library only), so that a plain script's restarted workers, forked from it, skip
their own imports. (Its event: `warm_imports`.)"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import SCRIPTS, events_of, finish, start, wait_for

from unbroken.runtime.warm_imports import MODULES_FILE

_WARM_INTERPRETER = """
import json, sys
from pathlib import Path
from unbroken.runtime.warm_imports import Preimporter
pre = Preimporter(Path(sys.argv[1]))
pre.paths.roots += (sys.argv[2] + "/",)  # stands for a site-packages with broken packages
sys.path.append(sys.argv[2])
assert pre.refresh()
while pre.pending:
    pre.step()
import os
print(json.dumps({"networkx": "networkx" in sys.modules, "local": "warm_local_mod" in sys.modules,
                  "colorsys": "colorsys" in sys.modules, "added": pre.added,
                  "refused": pre.refused, "failed": pre.failed, "dropped": pre.dropped,
                  "kept": sorted(m for m in sys.modules if m.startswith("warm_")),
                  "environ": type(os.environ).__name__}))
"""


def test_the_fork_servers_preimports_are_installed_modules_that_read_no_rank(tmp_path):
    """Names that are not dotted identifiers are ignored; a module found on the user's path
    (here the interpreter's cwd), even one shadowing a stdlib name, is refused unimported; one
    that fails to import is counted and skipped. A module that reads a rank's or job's
    variable at import (by `[]`, `get`, `in` or `os.getenv`), or imports one that does, is
    found so in a throwaway fork and never imported by the server, so that each worker
    imports it with its own rank; a listed module that reads none is imported."""
    marker = tmp_path / "ran"
    side_effect = f"open({str(marker)!r}, 'w').close()\n"
    (tmp_path / "warm_local_mod.py").write_text(side_effect)
    (tmp_path / "colorsys.py").write_text(side_effect)  # a stdlib name, shadowed in cwd
    site = tmp_path / "site"
    site.mkdir()
    (site / "warm_raises.py").write_text("raise RuntimeError('cannot import here')\n")
    (site / "warm_exits.py").write_text("import sys\nsys.exit(3)\n")
    (site / "warm_neutral.py").write_text("import os\nHOME = os.environ.get('HOME')\n")
    (site / "warm_reads_rank.py").write_text(
        "import os\nimport warm_neutral\nRANK = os.environ.get('RANK', '0')\n"
        "WORLD = os.getenv('WORLD_SIZE')\nMASTER = 'MASTER_ADDR' in os.environ\n")
    (site / "warm_imports_reader.py").write_text("import warm_reads_rank\n")
    listed = tmp_path / MODULES_FILE
    listed.write_text(json.dumps({"modules": [
        "warm_raises", "warm_exits", "warm_imports_reader", "warm_neutral", "networkx", "warm_local_mod", "colorsys",
        "os; import warm_local_mod", "1abc", 42, "__import__('warm_local_mod')",
        "no_such_module_at_all", "json.decoder"]}))
    res = subprocess.run([sys.executable, "-c", _WARM_INTERPRETER, str(listed), str(site)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["networkx"] and got["added"] > 10
    assert not got["local"] and not got["colorsys"] and not marker.exists()
    # warm_local_mod, colorsys (the cwd's), no_such_module_at_all
    assert sorted(got["refused"]) == ["colorsys", "no_such_module_at_all", "warm_local_mod"]
    assert got["failed"] == ["warm_raises", "warm_exits"]  # skipped, the interpreter goes on
    # Its import read them (in a throwaway fork): never imported here, nor what it imports.
    assert got["dropped"] == {"warm_imports_reader": ["MASTER_ADDR", "RANK", "WORLD_SIZE"]}
    assert got["kept"] == ["warm_neutral"] and got["environ"] == "_Environ"


def test_a_restarted_plain_script_finds_its_imports_done(tmp_path):
    """A plain script (no unbroken API) imports networkx, which `import torch` does not;
    rank 1 exits 1 in attempt 0. The fork server, which attempt 1's workers are forked from,
    has imported networkx from the list attempt 0 wrote, but not the script's own module."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    proc = start(run_dir, "--nproc-per-node", "2", "--max-restarts", "1", "--on-fault", "restart",
                 script=SCRIPTS / "plain_imports.py", args=[str(out)])
    try:
        wait_for(lambda: [e for e in events_of(run_dir, "warm_imports")
                          if e["source"] == "fork_server" and e["modules"] > 10], 90,
                 "the fork server to pre-import the workers' modules")
        (out / "go").touch()
        result = finish(proc, run_dir, timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result.code == 0, result.output
    for rank in (0, 1):
        assert json.loads((out / f"attempt0_rank{rank}.json").read_text()) == \
            {"networkx": False, "plain_imports_local": False}
        assert json.loads((out / f"attempt1_rank{rank}.json").read_text()) == \
            {"networkx": True, "plain_imports_local": False}
    names = json.loads((run_dir / "node_0" / MODULES_FILE).read_text())["modules"]
    assert "networkx" in names
    assert "plain_imports_local" not in names and "__main__" not in names
