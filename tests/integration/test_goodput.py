"""Goodput accounting (`telemetry.goodput`): the sweep's rules on hand-made events (no
processes), then a real run with a 2 s straggler and a crash that restarts every worker,
whose report is checked against its own event log."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import TINY, launch, unbroken_cmd

from unbroken.telemetry.categories import Category
from unbroken.telemetry.report import build_report, load_events

C = Category


@pytest.mark.serial  # measures time: alone, never beside another test
# ---------------------------------------------------------------- a real run
def test_a_straggler_and_a_crash_are_charged_to_their_categories(tmp_path):
    """A 2 s `slow` fault is 2 s of straggler on each rank; a crash restarts every worker,
    the time from it to each rank's next step is infrastructure recovery (with startup and
    restore inside it in theirs), and the steps computed again are wasted progress."""
    run_dir = tmp_path / "run"
    result = launch(run_dir, "--nproc-per-node", "2", "--max-restarts", "1", "--on-fault",
                    "restart", "--hang-timeout", "60", "--fault", "slow:rank=1,step=12,seconds=2",
                    "--fault", "crash:rank=0,step=53",
                    args=["--steps", "60", *TINY, "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--checkpoint-every", "10"])
    assert result.code == 0, result.output
    out = subprocess.run(unbroken_cmd("report", str(run_dir), "--json"), capture_output=True,
                         text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    assert 0 < r["goodput"] < 1 and set(r["badput_s"]) == {c.value for c in C} - {"productive_step"}
    assert sum(r["seconds"].values()) == pytest.approx(r["wall_s"], rel=0.01)
    assert r["seconds"]["straggler"] == pytest.approx(2.0, abs=0.2)
    assert r == build_report([run_dir]) | {"run_dir": r["run_dir"]}
    events = load_events([run_dir])
    steps = [e for e in events if e["event"] == "step"]
    # Wasted progress: exactly the computations of attempt 0 that attempt 1 computed again,
    # from the checkpoint it loaded up to the crash's step.
    again = {(e["slot"], e["step"]) for e in steps if e["attempt"] == 1}
    redone = [e for e in steps if e["attempt"] == 0 and (e["slot"], e["step"]) in again]
    loaded = {e["step"] for e in events if e["event"] == "checkpoint_loaded"}
    assert len(loaded) == 1 and 12 < min(loaded) < 53, loaded  # after the straggler's step
    assert sorted({e["step"] for e in redone}) == list(range(min(loaded), 53))
    (crash,) = r["faults"]
    assert crash["kind"] == "crash" and not crash["in_place"]
    assert crash["cost_s"]["wasted_progress"] == pytest.approx(sum(e["duration"] for e in redone),
                                                               rel=1e-3)
    # The crash's window on each rank: from the fault, or from the end of the rank's last step
    # of attempt 0 if that came later (rank 0 crashes entering step 53 while rank 1 may still
    # be finishing step 52, whose time is wasted progress: a CI run saw 14 ms of it), to that
    # rank's first step of attempt 1.
    began = next(e["t"] for e in events if e["event"] == "fault_injected" and e["kind"] == "crash")
    window = sum(min(e["t"] - e["duration"] for e in steps if e["attempt"] == 1
                     and e["slot"] == slot)
                 - max([began] + [e["t"] for e in steps if e["attempt"] == 0 and e["slot"] == slot])
                 for slot in (0, 1))
    charged = sum(v for k, v in crash["cost_s"].items() if k != "wasted_progress")
    assert charged == pytest.approx(window, rel=0.01)
    assert crash["cost_s"]["infrastructure_recovery"] > 0
    assert {"program_startup", "checkpoint_restore"} <= set(crash["cost_s"])
