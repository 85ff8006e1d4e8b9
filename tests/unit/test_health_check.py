"""A node's health check before it joins (launch/health_check.py): the plan of each mode,
the one line of a refusal, and the checks that need no process: memory against a need,
a write to a directory, the GPUs NVML must see. (The collective self-test runs processes:
tests/integration/test_health.py.)"""

from __future__ import annotations

from pathlib import Path

from unbroken.launch.health_check import (
    MIB,
    Check,
    HealthMode,
    check_gpus,
    check_memory,
    check_volume,
    plan,
    refusal,
    run,
)


def test_quick_and_full_plans():
    quick = plan(HealthMode.QUICK, volume="/ckpt", min_write_mbps=20, memory_need=None, gpus=8,
                 local_world=8, node_rank=3)
    assert (quick.write_bytes, quick.stagger_s, quick.volume) == (8 * MIB, 0.0, Path("/ckpt"))
    full = plan(HealthMode.FULL, volume=None, min_write_mbps=20, memory_need=None, gpus=0,
                local_world=2, node_rank=3)
    assert (full.write_bytes, full.stagger_s) == (64 * MIB, 1.5)
    assert plan(HealthMode.FULL, volume=None, min_write_mbps=20, memory_need=None, gpus=0,
                local_world=2, node_rank=500).stagger_s == 30.0
    assert run(plan(HealthMode.OFF, volume="/proc", min_write_mbps=20, memory_need=10**18,
                    gpus=8, local_world=8, node_rank=0)) == []


def test_a_refusal_is_the_first_failure_in_one_line():
    checks = [Check("memory", True, "fine", 0.0), Check("volume /c", False, "not writable", 0.1),
              Check("gpus", False, "none", 0.0)]
    line = refusal(checks)
    assert line.startswith("health check failed: volume /c: not writable;") and "exit 4" in line
    assert "\n" not in line and refusal(checks[:1]) is None


def test_memory_against_a_need():
    assert check_memory(None).ok and check_memory(1).ok
    short = check_memory(10**18)
    assert not short.ok and "GiB needed for the host copies" in short.detail


def test_a_volume_written_and_one_that_cannot_be(tmp_path):
    ok = check_volume(tmp_path, 2 * MIB, min_mbps=0.001)
    assert ok.ok and ok.detail.startswith("2 MiB at") and not list(tmp_path.iterdir())
    slow = check_volume(tmp_path, MIB, min_mbps=10**9)
    assert not slow.ok and "below the 1e+09 MB/s asked" in slow.detail
    gone = check_volume(tmp_path / "no-such-dir", MIB, min_mbps=1)
    assert not gone.ok and gone.detail.startswith("not writable")


def test_the_plan_stops_at_the_first_failure(tmp_path):
    checks = run(plan(HealthMode.QUICK, volume=str(tmp_path / "missing"), min_write_mbps=1,
                      memory_need=None, gpus=4, local_world=4, node_rank=0))
    assert [c.name for c in checks] == ["memory", f"volume {tmp_path / 'missing'}"]


def test_gpus_expected_where_nvml_is_absent_or_short():
    check = check_gpus(1)  # no NVIDIA driver on the machines that run this tier
    assert not check.ok and ("libnvidia-ml" in check.detail or "expected" in check.detail)
