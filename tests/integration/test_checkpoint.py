"""Atomic DCP checkpoints: torn, truncated, corrupt and hostile ones are never loaded."""

from __future__ import annotations

from conftest import TINY, launch

from unbroken.checkpoint.checkpointer import committed_checkpoints


def test_restart_skips_a_corrupt_checkpoint_and_resumes_from_the_previous(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    args = [*TINY, "--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", "5"]
    first = launch(tmp_path / "run1", "--nproc-per-node", "2", args=["--steps", "15", *args])
    assert first.code == 0, first.output
    kept = [s for s, _ in committed_checkpoints(ckpt_dir)]
    assert kept[0] == 15 and len(kept) >= 2, kept  # the final state is always committed
    victim = next((ckpt_dir / "step_000000015").glob("__1_*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-7])  # truncated, as by a full disk
    second = launch(tmp_path / "run2", "--nproc-per-node", "2", args=["--steps", "20", *args])
    assert second.code == 0, second.output
    invalid = second.events("checkpoint_invalid")
    assert invalid and invalid[0]["step"] == 15
    assert {e["step"] for e in second.events("resume")} == {kept[1]}
    assert sorted({e["step"] for e in second.events("step")}) == list(range(kept[1], 20))
