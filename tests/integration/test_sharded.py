"""Sharded state (FSDP2, HSDP) recovers in place: from a live replica, or from in-memory
snapshots replicated to a buddy; from storage only when every copy of a shard is gone.

Real workers under `unbroken run`, FSDP2 over gloo on CPU, real SIGKILLs. FSDP2's
reduce-scatter on gloo is deterministic for a fixed world, and every step's data and RNG
come from (seed, step, slot), so a run with a fault must end bit-identical to one without.
"""

from __future__ import annotations

import os
import signal

import torch
from conftest import REPO, SCRIPTS, events_of, finish, launch, start, wait_for

FSDP_TRAIN = SCRIPTS / "fsdp_train.py"
FSDP2_EXAMPLE = REPO / "examples" / "fsdp2" / "train.py"


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


def _clean(tmp_path, *args: str) -> list[torch.Tensor]:
    """The final state of the same job without a fault. Its steps are not paced: a step's
    sleep changes its time, never its state."""
    out = tmp_path / "clean.pt"
    unpaced = [a for i, a in enumerate(args)
               if a != "--step-sleep" and (i == 0 or args[i - 1] != "--step-sleep")]
    result = launch(tmp_path / "clean", "--nproc-per-node", "4", script=FSDP_TRAIN,
                    args=[*unpaced, "--out", str(out)], timeout=300)
    assert result.code == 0, result.output
    return torch.load(out, weights_only=True)


def test_fsdp_rank_killed_a_spare_takes_its_shard_from_the_buddy_in_place(tmp_path):
    """4 ranks of FSDP2, one SIGKILLed from outside once the spare is warm: the spare takes
    its slot with the shard from the buddy's in-memory snapshot, the survivors roll back to
    that snapshot in memory (at most K steps lost), and the run ends bit-identical."""
    every = 5
    args = ["--steps", "260", "--step-sleep", "0.05", "--snapshot-every", str(every)]
    clean = _clean(tmp_path, *args)
    run_dir, fast = tmp_path / "run", tmp_path / "fast"
    # Paced (50 ms steps, so the spare can warm up) until the recovery is seen; then at full
    # speed: the same steps and state.
    proc = start(run_dir, "--nproc-per-node", "4", "--spares", "1", "--max-restarts", "3",
                 script=FSDP_TRAIN, args=[*args, "--out", str(tmp_path / "faulty.pt"),
                                          "--sleep-until", str(fast)])
    ready = wait_for(lambda: events_of(run_dir, "spare_ready"), 150, "the spare to warm up")
    wait_for(lambda: any(e["step"] >= 2 * every for e in events_of(run_dir, "step")), 120,
             "steady training with a snapshot taken")
    victim = events_of(run_dir, "workers_started")[0]["pids"]["1"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: events_of(run_dir, "shard_sync"), 120, "the shards to be synced")
    fast.touch()
    result = finish(proc, run_dir, timeout=300)
    assert result.code == 0, result.output

    # The spare warmed up as one rank of the real world: it never held more than a shard.
    # The largest parameter (16 x 8 float32) is 512 bytes whole, 128 as a quarter.
    assert ready[0]["sharded"] and ready[0]["largest_tensor_bytes"] <= 512 // 4
    promoted = result.events("spare_promoted")
    assert promoted and promoted[0]["wid"] == ready[0]["wid"] and promoted[0]["slot"] == 1
    assert not result.events("replacement_started") and not result.events("restart")
    assert [e["world_size"] for e in result.events("gen_plan")] == [4]
    syncs = result.events("shard_sync")
    assert sorted(e["rank"] for e in syncs) == [0, 1, 2, 3]
    resumed = {e["step"] for e in syncs}
    assert len(resumed) == 1
    step = resumed.pop()
    fault_step = result.events("fault")[0]["step"]
    assert step % every == 0 and 0 <= fault_step - step <= every, (step, fault_step)
    # The spare (rank 1) received shard 1 from its buddy's snapshot; never from storage.
    (spare_sync,) = [e for e in syncs if e["rank"] == 1]
    assert spare_sync["sender"] == 2 and spare_sync["received_bytes"] > 0
    assert spare_sync["transfers"] == [[2, 1, False]]
    # A survivor restores its snapshot exactly when it had gone past it (a kill that lands
    # just after a snapshot round leaves nothing to roll back).
    survivors = [e for e in syncs if e["rank"] != 1]
    assert all(e["restored"] == (e["committed"] != step) for e in survivors), survivors
    assert not result.events("checkpoint_loaded")
    _same(torch.load(tmp_path / "faulty.pt", weights_only=True), clean)


def test_hsdp_rank_killed_gets_its_shard_from_the_replica_and_loses_no_step(tmp_path):
    """HSDP 2 x 2: the lost shard has a live replica in the other replica group, so it comes
    from there at the current step: nobody rolls back."""
    args = ["--hsdp", "--steps", "24", "--step-sleep", "0.05", "--snapshot-every", "5"]
    clean = _clean(tmp_path, *args)
    result = launch(tmp_path / "run", "--nproc-per-node", "4", "--max-restarts", "3",
                    "--fault", "crash:rank=1,step=12", script=FSDP_TRAIN,
                    args=[*args, "--out", str(tmp_path / "faulty.pt")], timeout=300)
    assert result.code == 0, result.output
    syncs = result.events("shard_sync")
    assert sorted(e["rank"] for e in syncs) == [0, 1, 2, 3]
    assert {e["step"] for e in syncs} == {12}  # the committed step: zero lost
    # Rank 1 (shard 1 of replica group 0) from rank 3 (shard 1 of replica group 1), live.
    assert all(e["transfers"] == [[3, 1, True]] for e in syncs)
    assert not any(e["restored"] for e in syncs)
    assert all(e["rolled_back"] == 0 for e in result.events("gen_switch"))
    assert not result.events("restart")
    _same(torch.load(tmp_path / "faulty.pt", weights_only=True), clean)


def test_a_shard_and_its_buddy_both_killed_fall_back_to_the_storage_checkpoint(tmp_path):
    """Rank 1 dies, and rank 2, which held the only other copy of shard 1 (its buddy's
    snapshot), dies as it is about to send it to rank 1's replacement (`at=send`). No step
    has every shard: the members say why, and the job restarts from the storage checkpoint.
    (Two crashes at the same step were not together: under load rank 2 was still in the
    staging collective before that step when rank 1 died, and sent the shard first.)"""
    ckpt = tmp_path / "ckpt"
    # The user's FSDP2 example (examples/fsdp2), tiny: its sharded checkpoints are restored.
    result = launch(tmp_path / "run", "--nproc-per-node", "4", "--max-restarts", "3",
                    "--fault", "crash:rank=1,step=12", "--fault", "crash:rank=2,step=12,at=send",
                    script=FSDP2_EXAMPLE, timeout=300,
                    args=["--steps", "20", "--step-sleep", "0.05", "--snapshot-every", "5",
                          "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4",
                          "--vocab", "16", "--dim", "16", "--heads", "2", "--layers", "1",
                          "--seq", "8", "--global-batch", "4", "--print-every", "1000"])
    assert result.code == 0, result.output
    (fallback,) = result.events("recovery_fallback")
    assert "shard(s) [1] have no copy left" in fallback["reason"], fallback
    assert result.events("switch_failed")
    assert result.events("restart")
    loaded = {e["step"] for e in result.events("checkpoint_loaded")}
    # A save of attempt 0: every 4 steps, or a step or two later where the one before was
    # still being written (a loaded machine defers it).
    saved = {e["step"] for e in result.events("checkpoint_saved") if e["attempt"] == 0}
    assert len(loaded) == 1 and loaded.pop() in saved and saved <= set(range(4, 13)), saved
    assert {e["slot"] for e in result.events("training_done")} == {0, 1, 2, 3}


def test_state_on_two_meshes_is_named_at_start_and_faults_restart_from_the_checkpoint(tmp_path):
    """What cannot be recovered in place is said in one line before the first step, and a
    crash restarts every worker at once, with no switch tried first."""
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--fault", "crash:rank=1,step=8", script=FSDP_TRAIN, timeout=300,
                    args=["--steps", "12", "--two-meshes", "--step-sleep", "0.05",
                          "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "3"])
    assert result.code == 0, result.output
    said = [e for e in result.events("in_place_unavailable") if e["attempt"] == 0]
    assert sorted(e["rank"] for e in said) == [0, 1]
    assert all("2 device meshes" in e["reason"] for e in said)
    assert result.output.count("in-place recovery is not available") >= 1
    assert result.events("restart")
    for wasted in ("gen_leave", "switch_failed", "gen_plan", "recovery_fallback"):
        assert not result.events(wasted), wasted
