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
    # Wasted: what each rank computed after the save it resumed from (the end of step 20,
    # job numbering 1-based; the script's step 19) until the fault: steps 21-28 and the
    # gaps between them (its dumps, the save's call), the last redone step running on to
    # when the fault began, here its `fault` event (the agent's notice of a SIGKILL it did
    # not inject: on a loaded machine a tenth of a second or more after the death). The
    # accounting's spans run from one step's end to the next, so this is measured the same
    # way, from the script's own clock.
    fault_t = result.events("fault")[0]["t"]
    for rank in (0, 1):
        assert ranks[rank]["checkpoint_restore"] > 0
        steps = _measured(out, 0, rank)["steps"]
        end_20 = next(end for step, _, end in steps if step == 2 * SAVE_EVERY - 1)
        lost = fault_t - end_20
        # A save's time inside the call is charged to checkpoint_save, whoever made it; a
        # rank that waited for rank 0's torch.save at its next collective has that wait
        # (the excess of its step over its median, at most the save's time) charged there
        # too (`watched_steps`' rule): so wasted is `lost` less between those two.
        own = _measured(out, 0, rank)["saves"]
        least = own[1] if own else 0.0
        most = own[1] if own else _measured(out, 0, 0)["saves"][1]
        assert 0.8 * (lost - most) - 0.02 <= ranks[rank]["wasted_progress"] \
            <= 1.2 * (lost - least) + 0.02, (rank, ranks[rank], lost, least, most, r["faults"])
    assert _measured(out, 0, 1)["steps"][-1][0] == KILL_AT
    # The projection of what this setup loses at scale, from the run's own saves.
    proc = subprocess.run(unbroken_cmd("simulate", "--gpus", "64", "--from-run", str(run_dir),
                                       "--job-mttf-hours", "1.8", "--seeds", "5"),
                          capture_output=True, text=True, timeout=120, check=True)
    first = proc.stdout.splitlines()[0]
    assert first.startswith("At 64 GPUs for 54 days, you lose ") and \
        " to synchronous checkpoints and " in first, first
    assert "the script's own checkpoints, stall_s" in proc.stdout and proc.stderr == ""
