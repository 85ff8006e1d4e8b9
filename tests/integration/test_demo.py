"""`unbroken demo`, the project's main job: 4 workers, three real faults, a summary."""

from __future__ import annotations

import subprocess

from conftest import REPO, unbroken_cmd

from unbroken.telemetry.report import build_report
from unbroken.telemetry.summary import summarize


def test_demo_recovers_from_a_kill_a_hang_and_an_exception(tmp_path):
    run_dir = tmp_path / "demo"
    res = subprocess.run(unbroken_cmd("demo", "--steps", "60", "--run-dir", str(run_dir)),
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    s = summarize(run_dir)
    assert s["steps"] == 60
    assert [f["kind"] for f in s["faults"]] == ["crash", "hang", "exception"]
    assert all(f["downtime"] is not None for f in s["faults"])
    assert s["final_loss"] < s["first_loss"] - 0.5
    for line in ("steps done      60", "faults          3", "1. crash", "2. hang", "3. exception"):
        assert line in res.stdout, res.stdout
    assert "step   50/60" in res.stdout  # progress printed while it runs
    # Goodput: every rank's seconds, by category, sum to the wall time (within 1 %); the
    # three recoveries are infrastructure recovery; the breakdown ends the summary.
    r = build_report([run_dir])
    assert r["world_size"] == 4 and 0 < r["goodput"] < 1
    assert abs(sum(r["seconds"].values()) - r["wall_s"]) <= 0.01 * r["wall_s"]
    for rank in r["ranks"]:
        assert abs(sum(rank["seconds"].values()) - r["wall_s"]) <= 0.01 * r["wall_s"]
    assert [f["kind"] for f in r["faults"]] == ["crash", "hang", "exception"]
    assert all(f["cost_s"].get("infrastructure_recovery", 0) > 0 for f in r["faults"])
    assert r["badput_s"]["infrastructure_recovery"] > 0
    assert "goodput " in res.stdout and "infrastructure_recovery" in res.stdout
    # `unbroken simulate --from-run` on it: the demo's recovery costs projected to 16,384
    # GPUs; its faults were injected, so no fault rate is derived from them.
    sim = subprocess.run(unbroken_cmd("simulate", "--from-run", str(run_dir), "--seeds", "10",
                                      "--json"), capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert sim.returncode == 0, sim.stdout + sim.stderr
    import json

    out = json.loads(sim.stdout)
    assert out["from_run"]["gpu_mtbf_hours"] is None
    lines = "\n".join(out["from_run"]["lines"])
    assert "0 real fault(s), 3 injected" in lines and "injected faults give costs" in lines
    switch = next(r["median"] for r in _measured(run_dir) if r["name"] == "switch_s")
    assert f"switch_s: median {switch:.3f} s" in lines  # the demo's own in-place switch
    assert out["in_place"]["ettr"] > out["torchrun"]["ettr"]


def _measured(run_dir):
    """The in-place switch times the demo's events hold, read here without the simulator."""
    import statistics

    durations = [g["duration"] for g in build_report([run_dir])["recoveries"] if g["faults"]]
    return [{"name": "switch_s", "median": statistics.median(durations)}]
