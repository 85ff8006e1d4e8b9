"""A node's health check before it joins (`unbroken run --health-check`), as real processes:
the collective self-test across a node's local ranks (gloo, two processes), and an agent
whose checkpoint volume cannot be written exits 4 (quarantined) with one line and starts
no worker. (The same refusal of a recreated pod, while the job goes on with its standby:
tests/integration/test_pods.py.)"""

from __future__ import annotations

import pytest
from conftest import TINY, launch

from unbroken.errors import ExitCode
from unbroken.launch.health_check import check_collective

pytestmark = pytest.mark.usefixtures("no_process_outlives_its_test")


def test_the_collective_self_test_all_reduces_across_the_nodes_ranks():
    check = check_collective(2, "gloo")
    assert check.ok, check
    assert check.name == "collective (gloo, 2 ranks)" and check.detail == "all-reduced"


def test_a_node_whose_volume_cannot_be_written_is_refused_with_exit_4(tmp_path):
    unwritable = "/proc/unbroken-cannot-write-here"
    result = launch(tmp_path / "run", "--nproc-per-node", "1", "--health-check", "full",
                    "--check-dir", unwritable, args=["--steps", "3", *TINY], timeout=120)
    assert result.code == ExitCode.QUARANTINED, result.output
    said = [line for line in result.output.splitlines() if "health check failed" in line]
    assert len(said) == 1 and f"volume {unwritable}: not writable" in said[0], result.output
    (checked,) = result.events("health_checked")
    assert checked["mode"] == "full" and checked["refused"] == said[0].split("] ", 1)[-1]
    assert [c["name"] for c in checked["checks"]] == ["memory", f"volume {unwritable}"]
    assert not result.events("workers_started")


def test_a_node_short_of_memory_for_its_host_copies_is_refused_with_exit_4(tmp_path):
    """The memory the host copies need (`--check-memory`, which `unbroken k8s` derives)
    against the room this process has: its cgroup's limit where lower than free memory."""
    result = launch(tmp_path / "run", "--nproc-per-node", "1", "--check-memory", "1Pi",
                    args=["--steps", "3", *TINY], timeout=120)
    assert result.code == ExitCode.QUARANTINED, result.output
    said = [line for line in result.output.splitlines() if "health check failed" in line]
    assert len(said) == 1 and "memory:" in said[0] and "needed for the host copies" in said[0]
    assert not result.events("workers_started")
