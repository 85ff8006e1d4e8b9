"""`unbroken demo`, the project's main job: 4 workers, three real faults, a summary."""

from __future__ import annotations

import subprocess

from conftest import REPO, unbroken_cmd

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
