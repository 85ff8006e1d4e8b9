"""A restart after silent data corruption loads the last verified checkpoint, not a newer
unverified one (issue 27). Real workers, a real bit flip, a real crash and restart."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, launch

from unbroken.checkpoint.layout import committed_checkpoints
from unbroken.checkpoint.manifest import MANIFEST


@pytest.mark.serial  # measures time: a save deferred under load would move the marks
def test_a_restart_after_sdc_loads_the_last_verified_checkpoint(tmp_path):
    """One bit of one parameter flipped on rank 1 after step 12's update: the replicas
    differ from step 13 on. Under `--on-sdc report` the checks at 15 and 20 fail, so the
    checkpoints of 15 and 20 are marked unverified, those of 5 and 10 verified. Rank 0
    crashes at step 24 and the whole job restarts (`--on-fault restart`): attempt 1 passes
    over 20 and 15 (each reported) and loads 10, whose replicas agreed.

    Steps take 0.2 s, so that no save is deferred behind the one before it (each is committed
    within its 5 steps, and 20 before the crash). The checkpoints are kept 3 at a time and
    attempt 1 writes 15 and 20 again, so the marks attempt 0 wrote are checked through what
    attempt 1 made of them: the unverified ones it reported passing over, the one it loaded."""
    ckpt = tmp_path / "ckpt"
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--on-fault", "restart",
                    "--fault", "bitflip:rank=1,step=12", "--fault", "crash:rank=0,step=24",
                    args=[*TINY, "--exact", "--steps", "25", "--step-sleep", "0.2", "--sdc", "--sdc-every", "5",
                          "--on-sdc", "report", "--checkpoint-dir", str(ckpt),
                          "--checkpoint-every", "5"])
    assert result.code == 0, result.output
    assert [(f["kind"], f["rank"], f["step"]) for f in result.events("fault")] == [("crash", 0, 24)]
    assert [e["attempt"] for e in result.events("restart")] == [1]
    # Attempt 0: the replicas agreed at 5 and 10, not at 15 and 20.
    checks = {e["step"]: e["ok"] for e in result.events("sdc_check") if e["attempt"] == 0}
    assert {s: checks.get(s) for s in (5, 10, 15, 20)} == {5: True, 10: True, 15: False, 20: False}
    saved = {e["step"] for e in result.events("checkpoint_saved")
             if e["attempt"] == 0 and e["rank"] == 0}
    assert {5, 10, 15, 20} <= saved, saved
    # Attempt 1 passed over the unverified 20 and 15, newest first, and loaded 10.
    invalid = [(e["step"], e["reason"]) for e in result.events("checkpoint_invalid")
               if e["attempt"] == 1]
    assert [s for s, _ in invalid] == [20, 15], invalid
    assert all(reason.startswith("unverified") for _, reason in invalid), invalid
    loaded = {(e["rank"], e["step"]) for e in result.events("checkpoint_loaded")
              if e["attempt"] == 1}
    assert loaded == {(0, 10), (1, 10)}, loaded
    assert {e["step"] for e in result.events("resume") if e["attempt"] == 1} == {10}
    # From 10 the replicas agree again (the flip fires once per job): every later check
    # passes, and the unverified 15 and 20 of attempt 0 were replaced by attempt 1's,
    # marked verified. Nothing left on disk is marked unverified.
    assert all(e["ok"] for e in result.events("sdc_check") if e["attempt"] == 1)
    manifests = {step: json.loads((path / MANIFEST).read_text())
                 for step, path in committed_checkpoints(ckpt)}
    assert {s: (manifests[s]["attempt"], manifests[s].get("verified"))
            for s in (15, 20) if s in manifests} == {15: (1, True), 20: (1, True)}, manifests
    assert not [s for s, m in manifests.items() if m.get("verified") is False], manifests
