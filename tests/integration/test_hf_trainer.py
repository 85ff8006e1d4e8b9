"""A Hugging Face Trainer job, unmodified (tests/scripts/hf_train.py), recovered in place by
the integration under `unbroken run`: real worker processes, a real gloo group, SIGKILL.

Each faulted run deletes the Trainer's output directory just before the kill, so that a
worker that read a checkpoint from storage would fail: the state can only come from a peer.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from conftest import REPO, assert_recovered_in_place, events_of, finish, launch, start, wait_for

pytest.importorskip("transformers")

SCRIPT = REPO / "examples" / "hf_trainer" / "train.py"
STEPS = 24


def _args(out, *extra: str) -> list[str]:
    return ["--output-dir", str(out), "--steps", str(STEPS), "--save-steps", "5", *extra]


def _kill_rank_1_after(run_dir, out, step: int) -> int:
    """SIGKILL rank 1 once the job has committed `step`. The Trainer's own checkpoints are
    left alone: in place, nothing reads them (`assert_recovered_in_place` fails on any
    restart), and deleting them here raced with a save in progress (a CI run under load
    removed `checkpoint-5` while rank 0 wrote it: a FileNotFoundError, not our fault)."""
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    wait_for(lambda: any(e["step"] >= step for e in events_of(run_dir, "step")), 120,
             f"step {step}", explain=run_dir)
    victim = started[0]["pids"]["1"]
    os.kill(victim, signal.SIGKILL)
    return started[0]["pids"]["0"]


FLAGS = ("--nproc-per-node", "2", "--max-restarts", "2", "--exact-reduction")
"""`--exact-reduction`: the Trainer's DDP sums in rank order, so runs compare bit for bit."""


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """The final parameters of the job run without a fault (gradient accumulation of 2)."""
    tmp = tmp_path_factory.mktemp("fault-free")
    clean = launch(tmp / "run", *FLAGS, script=SCRIPT, timeout=300,
                   args=_args(tmp / "out", "--accum", "2", "--final", str(tmp / "final.pt")))
    assert clean.code == 0, clean.output
    return torch.load(tmp / "final.pt", weights_only=True)


def _assert_identical(reference: dict, path) -> None:
    final = torch.load(path, weights_only=True)
    assert reference.keys() == final.keys()
    differ = [k for k in reference if not torch.equal(reference[k], final[k])]
    assert not differ, f"parameters differ from the fault-free run: {differ}"


@pytest.mark.parametrize("policy", [("--on-fault", "wait"), ()], ids=["wait", "torchrun-flags"])
def test_a_trainer_job_recovers_in_place_and_ends_bit_identical_to_a_fault_free_run(
        tmp_path, fault_free, policy):
    """Two workers, gradient accumulation of 2: the replacement takes the dead rank's slot
    with its state from the survivor, and the final parameters equal those of a run without
    the fault, bit for bit. With `--on-fault wait`, and with no flag beyond torchrun's (the
    drop-in as sold; `--on-fault` at its default, shrink): a Trainer's world never shrinks,
    where it used to shrink to one worker and fail (issue 42)."""
    flags = (*FLAGS, *policy)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = start(run_dir, *flags, script=SCRIPT,
                 args=_args(out, "--accum", "2", "--step-sleep", "0.1",
                            "--final", str(tmp_path / "faulted.pt")))
    survivor = _kill_rank_1_after(run_dir, out, 6)
    result = finish(proc, run_dir, timeout=300)
    assert_recovered_in_place(result, survivor, STEPS)
    assert all(e["world_size"] == 2 for e in result.events("gen_plan"))  # never shrunk
    _assert_identical(fault_free, tmp_path / "faulted.pt")


def test_a_fault_in_the_middle_of_gradient_accumulation_drops_the_partial_update(tmp_path):
    """Rank 1 is SIGKILLed as its update's first micro-batch starts (`--fault`): the
    survivor has accumulated its earlier micro-batches (no all-reduce until the last), meets
    the fault in the last one's, and redoes the whole update on the same inputs in the new
    generation; nothing half-accumulated is committed."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, "--nproc-per-node", "2", "--on-fault", "wait", "--max-restarts", "2",
                    "--fault", "crash:rank=1,step=6", script=SCRIPT, timeout=300,
                    args=_args(out, "--accum", "4", "--save-steps", "100"))
    survivor = result.events("workers_started")[0]["pids"]["0"]
    assert_recovered_in_place(result, survivor, STEPS)
    replayed = [(e["step"], e["micro_batches"]) for e in result.events("micro_batches_replayed")]
    assert replayed == [(6, 3)], replayed  # the survivor's three earlier micro-batches


def test_a_peer_killed_before_the_update_is_refused_at_the_fence_and_redone(
        tmp_path, fault_free):
    """Rank 1 dies at step 6's update point (`at=update`: its micro-batches reduced), rank 0
    held at the same point until its watchdog aborts the generation (`until=abort`), and the
    fence refuses its optimizer step inside the Trainer's loop. The adapter recovers there, runs
    the update's micro-batches again in the new generation and steps; the run ends
    bit-identical to the fault-free one."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, *FLAGS, "--on-fault", "wait",
                    "--fault", "crash:rank=1,step=6,at=update",
                    "--fault", "slow:rank=0,step=6,at=update,seconds=60,until=abort",
                    script=SCRIPT,
                    timeout=300, args=_args(out, "--accum", "2", "--save-steps", "100",
                                            "--final", str(tmp_path / "faulted.pt")))
    survivor = result.events("workers_started")[0]["pids"]["0"]
    assert_recovered_in_place(result, survivor, STEPS)
    leave = [e for e in result.events("gen_leave") if e["slot"] == 0][0]
    assert leave["step"] == 6 and leave["holds_state"], leave
    assert leave["error"].startswith("UpdateRefused"), leave
    replayed = [(e["step"], e["micro_batches"]) for e in result.events("micro_batches_replayed")]
    assert replayed == [(6, 2)], replayed  # both micro-batches, their reduction again
    _assert_identical(fault_free, tmp_path / "faulted.pt")


def test_a_trainer_jobs_spare_takes_the_dead_rank(tmp_path, fault_free):
    """The spare built its Trainer as rank 0 of a stand-in world; promoted, it trains slot
    1's data shard: the final parameters equal the fault-free run's."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    fast = tmp_path / "fast"  # steps sleep as GPU time would, until the spare has served
    proc = start(run_dir, *FLAGS, "--spares", "1", script=SCRIPT,
                 args=_args(out, "--accum", "2", "--step-sleep", "1", "--sleep-until", str(fast),
                            "--final", str(tmp_path / "faulted.pt")))
    wait_for(lambda: [e for e in events_of(run_dir, "spare_ready") if e["source"] == "worker"],
             180, "the spare to warm up", explain=run_dir)
    survivor = _kill_rank_1_after(run_dir, out, 1)
    wait_for(lambda: events_of(run_dir, "gen_up"), 120, "the recovery", explain=run_dir)
    fast.touch()
    result = finish(proc, run_dir, timeout=300)
    assert_recovered_in_place(result, survivor, STEPS)
    promoted = [e["slot"] for e in result.events("spare_promoted") if e["source"] == "worker"]
    assert promoted == [1]
    _assert_identical(fault_free, tmp_path / "faulted.pt")


def test_a_trainer_job_killed_before_its_spare_is_ready_waits_and_ends_bit_identical(
        tmp_path, fault_free):
    """`--spares 1`, rank 1 SIGKILLed in the job's first steps, before the spare has warmed
    up: a Trainer's world cannot shrink (Accelerate counts its processes once), so the
    survivor waits for a spare or a replacement, saying so in one line, and the job ends
    bit-identical to the fault-free run (issue 42: it used to shrink to one worker, fail its
    item-count gather three times and exit 1)."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = start(run_dir, *FLAGS, "--spares", "1", script=SCRIPT,
                 args=_args(out, "--accum", "2", "--step-sleep", "0.1",
                            "--final", str(tmp_path / "faulted.pt")))
    survivor = _kill_rank_1_after(run_dir, out, 1)
    ready_before = [e for e in events_of(run_dir, "spare_ready") if e["source"] == "worker"]
    result = finish(proc, run_dir, timeout=300)
    assert not ready_before, "the spare was ready before the kill: not the case under test"
    assert_recovered_in_place(result, survivor, STEPS)
    assert "waiting up to" in result.output and "the Trainer cannot change its world size" \
        in result.output, result.output
    assert all(e["world_size"] == 2 for e in result.events("gen_plan"))  # never shrunk
    _assert_identical(fault_free, tmp_path / "faulted.pt")


def test_no_integrations_leaves_the_trainer_alone(tmp_path):
    """`--no-integrations`: the same fault restarts every worker (the script resumes from
    its own checkpoint), as under torchrun."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    proc = start(run_dir, "--nproc-per-node", "2", "--max-restarts", "2", "--no-integrations",
                 script=SCRIPT, args=_args(out, "--resume", "--step-sleep", "0.1"))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start")
    # trainer_state.json is the save's last file: the Trainer's saves are not atomic.
    wait_for(lambda: (out / "checkpoint-5" / "trainer_state.json").is_file(), 120,
             "the Trainer's first checkpoint", explain=run_dir)
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    result = finish(proc, run_dir, timeout=300)
    assert result.code == 0, result.output
    assert len(result.events("restart")) == 1, result.output
    assert not result.events("gen_up") and not result.events("step")  # no Run: unprotected
    watched = [e for e in result.events() if e["event"].startswith("script_")]
    assert not watched, watched[:3]  # and not measured either: every hook is off


SAVE_FAULT = REPO / "tests" / "scripts" / "hf_save_fault.py"


def test_a_fault_in_the_trainers_own_checkpoint_save_is_recovered_in_place(tmp_path, fault_free):
    """Rank 1 is SIGKILLed inside the Trainer's checkpoint save at step 10 (as it saves the
    optimizer and scheduler). The survivor finishes its save (a DDP save has no collective),
    meets the fault in the next update's first collective and recovers there; the
    replacement takes its state from the survivor, and the final parameters equal the
    fault-free run's."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    result = launch(run_dir, *FLAGS, "--on-fault", "wait", script=SAVE_FAULT, timeout=300,
                    args=["--kill-in-save", "10",
                          *_args(out, "--accum", "2", "--final", str(tmp_path / "faulted.pt"))])
    survivor = result.events("workers_started")[0]["pids"]["0"]
    assert_recovered_in_place(result, survivor, STEPS)
    assert [f["step"] for f in result.events("fault")] == [10]
    _assert_identical(fault_free, tmp_path / "faulted.pt")


ANOMALIES = REPO / "tests" / "scripts" / "hf_anomalies.py"


def test_a_persistent_nan_is_skipped_on_every_rank(tmp_path):
    """Numerical checks on (`unbroken.init(anomalies=...)` handed to `protect`), a NaN in rank
    1's gradients at step 4 that comes back when the update is run again: the adapter
    checks each update after its micro-batches' backward, runs the update again on the
    verdict RERUN, and on SKIPPED makes no optimizer step (the LR schedule held) and goes on.
    Every rank skips step 4, no step commits a non-finite loss, and the final parameters equal
    those of a run that passed over step 4 (`run.skip_steps`, honoured at the update's start)."""
    steps, bad = 10, 4
    job = ["--steps", str(steps), "--accum", "2", "--save-steps", "100"]
    flags = ("--nproc-per-node", "2", "--max-restarts", "0", "--exact-reduction")
    reference = launch(tmp_path / "ref", *flags, script=ANOMALIES, timeout=120,
                       args=["--skip-steps", str(bad), "--output-dir", str(tmp_path / "ref-out"),
                             *job, "--final", str(tmp_path / "reference.pt")])
    assert reference.code == 0, reference.output
    assert sorted((e["rank"], e["step"], e["reason"]) for e in reference.events("step_skipped")) \
        == [(0, bad, "asked"), (1, bad, "asked")]
    result = launch(tmp_path / "run", *flags, "--fault", f"nan:rank=1,step={bad},persistent=1",
                    script=ANOMALIES, timeout=120,
                    args=["--output-dir", str(tmp_path / "out"), *job,
                          "--final", str(tmp_path / "faulted.pt")])
    assert result.code == 0, result.output
    assert not result.events("fault") and not result.events("restart")
    skipped = sorted((e["rank"], e["step"], e["reason"]) for e in result.events("step_skipped"))
    assert skipped == [(0, bad, "nan"), (1, bad, "nan")]
    assert [(e["step"], e["cause"]) for e in result.events("anomaly_classified")] == [(bad, "data")]
    dropped = sorted((e["rank"], e["step"]) for e in result.events("step_dropped"))
    assert dropped == [(0, bad), (1, bad)]  # the rerun
    committed = result.events("step")
    assert sorted(e["step"] for e in committed if e["rank"] == 0) == \
        [s for s in range(steps) if s != bad]
    assert len(committed) == 2 * (steps - 1)
    assert all(math.isfinite(e["loss"]) for e in committed)
    _assert_identical(torch.load(tmp_path / "reference.pt", weights_only=True),
                      tmp_path / "faulted.pt")
