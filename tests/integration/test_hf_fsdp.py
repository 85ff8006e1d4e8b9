"""The Trainer example under the Trainer's own FSDP2 path (Accelerate's `fsdp2_prepare_model`,
torch's `fully_shard` on a cpu mesh, gloo), recovered in place by the integration under
`unbroken run`: real worker processes, SIGKILL. tests/scripts/hf_fsdp_train.py lifts
Accelerate's CPU guard on FSDP (and nothing else); the example runs unchanged.

The faulted run deletes the Trainer's output directory just before the kill: the
replacement's shard can only come from a peer's memory.
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from conftest import REPO, events_of, finish, launch, start, wait_for

pytest.importorskip("transformers")

SCRIPT = REPO / "tests" / "scripts" / "hf_fsdp_train.py"
STEPS = 16
FLAGS = ("--nproc-per-node", "2", "--max-restarts", "2", "--on-fault", "wait")
"""Two ranks: FSDP2's reduce-scatter and the gradient norm's all-reduce each add two values,
which IEEE addition does in either order to the same bits, so runs compare bit for bit."""


def _args(out, shards, *extra: str) -> list[str]:
    return ["--output-dir", str(out), "--steps", str(STEPS), "--save-steps", "5",
            "--shards", str(shards), *extra]


def _shards(path) -> list[dict]:
    return [torch.load(f"{path}.{rank}", weights_only=True) for rank in (0, 1)]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """Each rank's final shards from the job run without a fault."""
    tmp = tmp_path_factory.mktemp("fsdp-fault-free")
    clean = launch(tmp / "run", *FLAGS, script=SCRIPT, timeout=300,
                   args=_args(tmp / "out", tmp / "final"))
    assert clean.code == 0, clean.output
    assert clean.events("step"), "the Trainer's steps were not on the engine"
    return _shards(tmp / "final")


def test_a_trainer_job_under_fsdp2_recovers_in_place(tmp_path, fault_free):
    """Rank 1 is SIGKILLed mid-epoch. The survivor keeps its process and its shard in
    memory; the engine rebinds its FSDP2 mesh on the new generation's group. Rank 1's shard
    lived only in rank 1 and in the survivor's in-memory snapshot of it (taken every few
    steps), so the replacement gets it from that snapshot and the survivor rolls back to the
    snapshot's step: its Trainer loop runs those steps again on the same batches (nothing
    is read from storage), and every rank's final shards equal the fault-free run's, bit
    for bit. Without a replica of each shard, no step redone needs a snapshot every step."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = start(run_dir, *FLAGS, script=SCRIPT,
                 args=_args(out, tmp_path / "faulted", "--step-sleep", "0.1"))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    # The interval is set once two timed snapshot rounds (at steps 5 and 6) are taken.
    wait_for(lambda: events_of(run_dir, "snapshot_config"), 120, "the snapshots' interval",
             explain=run_dir)
    shutil.rmtree(out, ignore_errors=True)  # no checkpoint on storage to recover from
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    result = finish(proc, run_dir, timeout=300)
    assert result.code == 0, result.output
    assert [(f["kind"], f["rank"]) for f in result.events("fault")] == [("crash", 1)]
    assert not result.events("restart"), "fell back to a full restart"
    done = {e["slot"]: e["pid"] for e in result.events("training_done")}
    assert done[0] == started[0]["pids"]["0"], "the survivor changed process"
    switch = {e["slot"]: e for e in result.events("gen_switch")}
    assert switch[1]["state_from"] == 0 and switch[1]["received_bytes"] > 0
    every = result.events("snapshot_config")[0]["every"]
    resumed, redone = switch[0]["step"], switch[0]["rolled_back"]
    assert 0 <= redone <= every
    steps = [e["step"] for e in result.events("step") if e["slot"] == 0]
    assert steps == [*range(resumed + redone), *range(resumed, STEPS)], steps
    for rank, (reference, final) in enumerate(zip(fault_free, _shards(tmp_path / "faulted"), strict=True)):
        differ = [k for k in reference if not torch.equal(reference[k], final[k])]
        assert not differ, f"rank {rank}'s shards differ from the fault-free run's: {differ}"


def test_a_trainer_job_under_fsdp2_has_its_dead_rank_taken_by_a_spare(tmp_path, fault_free):
    """The spare built its Trainer and sharded its model as rank 0 of a stand-in world (every
    rank's shard has the same shapes here); promoted, it takes slot 1 with that slot's shard
    from the survivor's snapshot, and the final shards equal the fault-free run's."""
    run_dir, out, fast = tmp_path / "run", tmp_path / "out", tmp_path / "fast"
    proc = start(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", "--spares", "1",
                 script=SCRIPT, args=_args(out, tmp_path / "faulted", "--step-sleep", "1",
                                           "--sleep-until", str(fast)))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    wait_for(lambda: [e for e in events_of(run_dir, "spare_ready") if e["source"] == "worker"],
             180, "the spare to warm up", explain=run_dir)
    wait_for(lambda: events_of(run_dir, "snapshot_config"), 120, "the snapshots' interval",
             explain=run_dir)
    shutil.rmtree(out, ignore_errors=True)
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    wait_for(lambda: events_of(run_dir, "gen_up"), 120, "the recovery", explain=run_dir)
    fast.touch()
    result = finish(proc, run_dir, timeout=300)
    assert result.code == 0, result.output
    assert not result.events("restart"), "fell back to a full restart"
    done = {e["slot"]: e["pid"] for e in result.events("training_done")}
    assert done[0] == started[0]["pids"]["0"], "the survivor changed process"
    assert [e["slot"] for e in result.events("spare_promoted") if e["source"] == "worker"] == [1]
    switch = {e["slot"]: e for e in result.events("gen_switch")}
    assert switch[1]["state_from"] == 0 and switch[1]["received_bytes"] > 0
    for rank, (reference, final) in enumerate(zip(fault_free, _shards(tmp_path / "faulted"), strict=True)):
        differ = [k for k in reference if not torch.equal(reference[k], final[k])]
        assert not differ, f"rank {rank}'s shards differ from the fault-free run's: {differ}"
