"""An unchanged torchrun-style script under `unbroken run --max-restarts 2`: its steps (torch's
global optimizer hooks), its own checkpoints (torch.save then os.replace on rank 0, or a DCP
save on every rank), one SIGKILL and the restart from its own file, accounted. The script
(`tests/scripts/plain_saver.py`) measures itself; the report must agree with it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import launch, unbroken_cmd

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "plain_saver.py"
SAVE_EVERY, KILL_AT, STEPS = 10, 27, 40  # the run resumes from step 20: steps 20-27 redone


def _measured(out: Path, attempt: int, rank: int) -> dict:
    return json.loads((out / f"measured-{attempt}-{rank}.json").read_text())


@pytest.mark.parametrize("form", ["torch.save", "dcp"])
def test_an_unchanged_scripts_saves_restart_and_redone_steps_are_accounted(tmp_path, form):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    result = launch(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", script=SCRIPT,
                    args=[str(out), str(tmp_path / "ckpt"), "--steps", str(STEPS), "--every",
                          str(SAVE_EVERY), "--kill-at", str(KILL_AT),
                          *(["--dcp"] if form == "dcp" else [])])
    assert result.code == 0, result.output
    assert [f["kind"] for f in result.events("fault")] == ["crash"]  # the one SIGKILL
    proc = subprocess.run(unbroken_cmd("report", str(run_dir), "--json"), capture_output=True,
                          text=True, timeout=120, check=True)
    r = json.loads(proc.stdout)
    assert r["steps_known"] is True
    assert r["watched"]["resumed_from"] == {"1": 20} and not r["watched"]["notes"]
    ranks = {x["slot"]: x["seconds"] for x in r["ranks"]}
    total = r["world_size"] * r["wall_s"]
    assert sum(s["untracked"] for s in ranks.values()) <= 0.10 * total
    # Steps: every step of both attempts, numbered as the job's.
    kept = sorted(s["step"] for s in r["steps"] if s["slot"] == 0 and not s["redone"])
    assert kept == list(range(1, STEPS + 1)), kept
    # Saves: the saving rank's time inside the call, as the script measured it; the job's
    # (every rank, the waiters included) between 1x and Wx that.
    savers = [0] if form == "torch.save" else [0, 1]
    for rank in savers:
        inside = sum(sum(_measured(out, a, rank)["saves"]) for a in (0, 1))
        assert ranks[rank]["checkpoint_save"] == pytest.approx(inside, rel=0.2)
    one = sum(sum(_measured(out, a, 0)["saves"]) for a in (0, 1))
    job = sum(s["checkpoint_save"] for s in ranks.values())
    assert one * 0.8 <= job <= 2 * one * 1.2, (job, one)
    # Wasted: the steps after the save it resumed from (21-27), computed again. As the killed
    # rank timed them: it wrote step 27 before its SIGKILL, while rank 0 may be stopped by
    # the agent before it writes its own (the ranks' steps are in lockstep: one all-reduce).
    # Rank 0 also loses the step the fault cut short: it computed step 28 from the end of
    # step 27 until its workers were stopped (a CI run under load stretched that window to
    # 0.12 s past the tolerance: it is charged, and belongs to the expectation).
    steps = _measured(out, 0, 1)["steps"]
    assert steps[-1][0] == KILL_AT
    # As the script times its steps, step 20's span holds the wait for rank 0's save at
    # its end; the accounting's spans run from one step's end to the next, so that wait
    # falls in the redone span after it. Summed from step 20, the two agree but for it.
    redone = sum(end - start for step, start, end in steps if step >= 2 * SAVE_EVERY)
    stopped = max(e["t"] for e in result.events("fault") + result.events("workers_stopped")
                  if e.get("attempt", 0) == 0)
    cut_short = max(0.0, stopped - steps[-1][2])
    for rank in (0, 1):
        assert ranks[rank]["checkpoint_restore"] > 0
    # With torch.save only rank 0 saves, and rank 1 waits for it at its next collective:
    # that wait (the excess of its step after the save over its median step, at most the
    # save's time) is charged to checkpoint_save, not to the redone steps (`watched_steps`'
    # rule). So rank 1's wasted is the redone steps' time less at most the save's.
    save_20 = _measured(out, 0, 0)["saves"][1] if form == "torch.save" else 0.0
    assert 0.8 * (redone - save_20) - 0.02 <= ranks[1]["wasted_progress"] <= 1.2 * redone, \
        (ranks[1], redone, save_20, r["faults"])
    assert 0.8 * (redone - save_20) - 0.02 <= ranks[0]["wasted_progress"] \
        <= 1.2 * redone + cut_short, \
        (ranks[0], redone, cut_short, r["faults"])
    # The projection of what this setup loses at scale, from the run's own saves.
    proc = subprocess.run(unbroken_cmd("simulate", "--gpus", "64", "--from-run", str(run_dir),
                                       "--job-mttf-hours", "1.8", "--seeds", "5"),
                          capture_output=True, text=True, timeout=120, check=True)
    first = proc.stdout.splitlines()[0]
    assert first.startswith("At 64 GPUs for 54 days, you lose ") and \
        " to synchronous checkpoints and " in first, first
    assert "the script's own checkpoints, stall_s" in proc.stdout and proc.stderr == ""
