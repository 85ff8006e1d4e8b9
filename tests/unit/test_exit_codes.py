"""The exit-code taxonomy is declared once (`errors.ExitCode`, `errors.RETRY`) and the
table in docs/troubleshoot.md ("Exit codes") says the same. Each code is shown by a real run
elsewhere:

| code | test |
|---|---|
| 0 | every end-to-end test, e.g. test_share_nothing.py's torchrun forms |
| 1 | test_outcomes.py (`assert_gave_up`) |
| 2 | test_lifecycle.py::test_bad_input_gets_one_clear_line, test_share_nothing.py (a node with another secret), test_etcd_security.py |
| 3 | test_lifecycle.py::test_port_in_use_is_reported, test_failover.py (a host cut off) |
| 4 | test_failover.py::test_a_lemon_node_is_quarantined_and_its_ranks_go_to_the_standby |
| 130, 143 | test_lifecycle.py::test_sigterm_stops_workers_cleanly, test_share_nothing.py (SIGTERM) |
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from unbroken.cli import main
from unbroken.control.backend import StoreMisconfigured, StoreUnavailable
from unbroken.errors import RETRY, ConfigError, ControlPlaneError, ExitCode, Retry, UserError

DOC = Path(__file__).resolve().parents[2] / "docs" / "troubleshoot.md"


def _doc_table() -> dict[int, str]:
    text = DOC.read_text()
    start = text.index("\n## Exit codes\n")
    section = text[start:text.index("\n## ", start + 1)]
    rows = {}
    for codes, retry in re.findall(r"^\| ([\d, ]+) \| .* \| ([a-z]+)[^|]* \|$", section, re.M):
        for code in codes.split(","):
            rows[int(code)] = retry
    return rows


def test_the_doc_table_lists_every_code_with_its_retry_action():
    assert _doc_table() == {int(code): RETRY[code].value for code in ExitCode}


def test_every_code_has_one_action_and_permanent_errors_are_never_retried():
    assert set(RETRY) == set(ExitCode)
    assert RETRY[ExitCode.USAGE] == RETRY[ExitCode.GAVE_UP] == Retry.NEVER
    assert RETRY[ExitCode.CONTROL_PLANE] == Retry.NODE
    assert RETRY[ExitCode.QUARANTINED] not in (Retry.NONE, Retry.NODE)  # never "the job done"


def test_each_error_class_carries_its_code():
    assert UserError("x").exit_code == ConfigError("x").exit_code == ExitCode.USAGE
    assert ControlPlaneError("x").exit_code == StoreUnavailable("x").exit_code \
        == ExitCode.CONTROL_PLANE
    assert StoreMisconfigured("x").exit_code == ExitCode.USAGE  # a wrong password: permanent


def test_version_names_unbroken_and_torch_and_exits_0(capsys):

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("unbroken 0.") and "(torch 2." in out, out
