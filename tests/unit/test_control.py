"""The control package's rules, in process: message types and codecs, and the rules that
keep the protocol in one place (no key built outside the schema, no arrow running back up).
The events' rules: tests/unit/test_event_schema.py. (Real stores:
tests/integration/test_control.py.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from unbroken.control.codec import decode
from unbroken.control.messages import (
    Fault,
    FaultKind,
)
from unbroken.control.worker_env import Role, WorkerEnv

SRC = Path(__file__).resolve().parents[2] / "src" / "unbroken"


def test_decoding_builds_only_declared_types():
    text = '{"kind": "crash", "rank": 1, "__class__": "os.system", "unknown": [1]}'
    fault = decode(Fault, text)
    assert fault == Fault(kind=FaultKind.CRASH, rank=1)
    with pytest.raises(ValueError):
        decode(Fault, '{"kind": "rm -rf"}')


def test_the_worker_environment_round_trips():
    env = WorkerEnv(rank=3, world_size=4, local_rank=1, attempt=2, control="tcp://127.0.0.1:4000",
                    in_place=True, slot=3, worker_id="3.1", joining=True,
                    role=Role.SPARE, run_dir="/tmp/x", heartbeat_file="/tmp/x/hb", agent_store=True)
    back = WorkerEnv.from_environ(env.to_environ())
    assert back == env
    plain = WorkerEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "GROUP_RANK": "1"})
    assert (plain.rank, plain.node_rank, plain.under_agent, plain.in_place) == (1, 1, False, False)


def _python_files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in (SRC / pkg).rglob("*.py")]


def test_no_store_key_is_built_outside_the_schema():
    key_shape = re.compile(r"""f?["'](a/|g/|unbroken/|claim/|lease/|ack/|news|current|result)""")
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "control":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
                    "get", "set", "add", "check", "compare_set", "wait"):
                for arg in node.args[:1]:
                    if isinstance(arg, (ast.Constant, ast.JoinedStr)) and key_shape.match(
                            ast.unparse(arg)):
                        offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == []


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("package, forbidden", [
    ("runtime", ("unbroken.launch",)),
    ("checkpoint", ("unbroken.launch", "unbroken.runtime")),
    ("control", ("unbroken.launch", "unbroken.runtime", "unbroken.checkpoint")),
])
def test_no_import_arrow_runs_back_up(package, forbidden):
    bad = [(p.name, m) for p in _python_files(package) for m in _imports(p)
           if m.startswith(forbidden)]
    assert bad == []
