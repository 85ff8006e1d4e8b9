"""A Lightning job, unmodified (examples/lightning/train.py, `strategy="ddp"`, gradient
accumulation over 2 batches), recovered in place by the integration under `unbroken run`:
real worker processes, a real gloo group, SIGKILL. The replacement's state can only come
from a peer: the job saves no checkpoint, or (the save's test) none the replacement reads.
"""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch
from conftest import (
    REPO,
    SCRIPTS,
    assert_recovered_in_place,
    events_of,
    finish,
    launch,
    start,
    wait_for,
)

pytest.importorskip("lightning")

SCRIPT = REPO / "examples" / "lightning" / "train.py"
STEPS = 18  # 12 batches, 6 steps an epoch: the faults land in the first two, the job ends in the third
FLAGS = ("--nproc-per-node", "2", "--on-fault", "wait", "--max-restarts", "2")
JOB = ("--steps", str(STEPS), "--accum", "2", "--val-every", "5")
"""Every run's job: validation every 5 batches (in the middle of an update, every other time)."""


def _kill_rank_1_after(run_dir, step: int) -> int:
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    wait_for(lambda: any(e["step"] >= step for e in events_of(run_dir, "step")), 120,
             f"step {step}", explain=run_dir)
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    return started[0]["pids"]["0"]


def _assert_same_params(reference_path, final_path) -> None:
    reference = torch.load(reference_path, weights_only=True)
    final = torch.load(final_path, weights_only=True)
    assert reference.keys() == final.keys()
    differ = [k for k in reference if not torch.equal(reference[k], final[k])]
    assert not differ, f"parameters differ from the fault-free run: {differ}"


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    """The final parameters of the job without a fault."""
    tmp = tmp_path_factory.mktemp("clean")
    clean = launch(tmp / "run", *FLAGS, script=SCRIPT, timeout=300,
                   args=[*JOB, "--final", str(tmp / "clean.pt")])
    assert clean.code == 0, clean.output
    return tmp / "clean.pt"


def _faulted(tmp_path, *extra: str, flags=(), script=SCRIPT, before=()):
    run_dir = tmp_path / "run"
    proc = start(run_dir, *FLAGS, *flags, script=script,
                 args=[*before, *JOB, "--final", str(tmp_path / "faulted.pt"), *extra])
    return run_dir, proc


def test_a_lightning_fit_recovers_in_place_and_ends_bit_identical_to_a_fault_free_run(
        tmp_path, fault_free):
    """Two workers, rank 1 SIGKILLed mid-epoch, `--on-fault wait`: the survivor stays in
    `fit()`, the replacement takes the model, optimizer (momentum), LR scheduler and loops
    from it, skips the batches already trained, and the final parameters equal those of a run
    without the fault, bit for bit (two ranks' sums are exact)."""
    run_dir, proc = _faulted(tmp_path, "--step-sleep", "0.1")
    survivor = _kill_rank_1_after(run_dir, 3)
    result = finish(proc, run_dir, timeout=300)
    assert_recovered_in_place(result, survivor, STEPS)
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_the_standalone_pytorch_lightning_package_recovers_in_place_bit_identical(
        tmp_path, fault_free):
    """The same job on the standalone `pytorch_lightning` package at an old release (CI
    pins 2.4.0 beside `lightning` 2.6.6): its `strategy="ddp"` is replaced as the
    `lightning` package's is, rank 1 is SIGKILLed, the survivor stays in `fit()`, and the
    final parameters equal the fault-free run's on `lightning`, bit for bit (both releases
    draw the same batches and make the same updates)."""
    pytest.importorskip("pytorch_lightning")
    run_dir, proc = _faulted(tmp_path, "--step-sleep", "0.1", "--package", "pytorch_lightning")
    survivor = _kill_rank_1_after(run_dir, 3)
    result = finish(proc, run_dir, timeout=300)
    assert "trains unprotected" not in result.output, result.output
    assert_recovered_in_place(result, survivor, STEPS)
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_a_fault_during_validation_is_recovered_at_the_next_step(tmp_path, fault_free):
    """Rank 1 dies while both validate, after batch 5, in the middle of step 2's update: the
    survivor's epoch-end `sync_dist` reduce fails and gives its local value; at the update's
    last batch the survivor recovers in place and runs batch 5 again (the half-accumulated
    update is dropped), from the RNG state it had (the validation drew from it); the
    replacement runs batch 5 and its validation with local collectives."""
    run_dir, proc = _faulted(tmp_path, "--val-sleep", "0.6")
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    wait_for(lambda: any(e["step"] >= 1 for e in events_of(run_dir, "step")), 120, "step 1",
             explain=run_dir)
    time.sleep(0.3)  # inside the first validation's first batch
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    result = finish(proc, run_dir, timeout=300)
    assert "a Lightning collective outside a step" in result.output
    assert_recovered_in_place(result, started[0]["pids"]["0"], STEPS)
    replayed = [(e["step"], e["micro_batches"]) for e in result.events("micro_batches_replayed")]
    assert replayed == [(2, 1)], replayed
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_a_fault_in_the_middle_of_gradient_accumulation_drops_the_partial_update(
        tmp_path, fault_free):
    """Rank 1 is SIGKILLed as step 4's update starts (`--fault`): the survivor accumulates
    its first batch (no all-reduce), meets the fault in the last one's, and redoes the whole
    update in the new generation on the same inputs; nothing half-accumulated is committed,
    and the final parameters equal the fault-free run's."""
    run_dir, proc = _faulted(tmp_path, flags=("--fault", "crash:rank=1,step=4"))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    result = finish(proc, run_dir, timeout=300)
    assert_recovered_in_place(result, started[0]["pids"]["0"], STEPS)
    replayed = [(e["step"], e["micro_batches"]) for e in result.events("micro_batches_replayed")]
    assert replayed == [(4, 1)], replayed  # the survivor's earlier batch
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_a_peer_killed_before_the_update_is_refused_at_the_fence(tmp_path, fault_free):
    """Rank 1 dies at step 4's update point (`at=update`: after its last closure's reduction
    and the check), rank 0 held there until its watchdog aborts the generation (`until=abort`,
    whatever the notice takes on a loaded machine): the strategy's fence after the closure refuses
    rank 0's update (the optimizer's own pre-hook, before the closure, let it by); the
    update is redone in the new generation, its earlier batch first, and the final
    parameters equal the fault-free run's."""
    held = "slow:rank=0,step=4,at=update,seconds=60,until=abort"
    run_dir, proc = _faulted(tmp_path, flags=("--fault", "crash:rank=1,step=4,at=update",
                                              "--fault", held))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    result = finish(proc, run_dir, timeout=300)
    assert_recovered_in_place(result, started[0]["pids"]["0"], STEPS)
    leave = [e for e in result.events("gen_leave") if e["slot"] == 0][0]
    assert leave["step"] == 4 and leave["error"].startswith("UpdateRefused"), leave
    replayed = [(e["step"], e["micro_batches"]) for e in result.events("micro_batches_replayed")]
    assert replayed == [(4, 1)], replayed
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_a_fault_inside_lightnings_own_checkpoint_save_is_recovered_at_the_next_step(
        tmp_path, fault_free):
    """`ModelCheckpoint` every 3 steps; rank 1 SIGKILLed inside the save at step 9, after
    its dump (tests/scripts/lightning_save_fault.py): the survivor writes the checkpoint,
    its save's barrier fails and gives way, and the next step recovers in place. The
    replacement reads no checkpoint; the saves go on to the last step."""
    ckpt = tmp_path / "ckpt"
    run_dir, proc = _faulted(tmp_path, "--checkpoint-every", "3", "--checkpoint-dir", str(ckpt),
                             script=SCRIPTS / "lightning_save_fault.py",
                             before=("--kill-in-save", "9"))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    result = finish(proc, run_dir, timeout=300)
    assert "rank 1 killed inside the checkpoint save at step 9" in result.output
    assert "a Lightning collective outside a step" in result.output
    assert_recovered_in_place(result, started[0]["pids"]["0"], STEPS)
    assert [p.name for p in ckpt.iterdir()] == [f"epoch=2-step={STEPS}.ckpt"]
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_an_exception_in_a_callback_replaces_that_worker_only(tmp_path, fault_free):
    """Rank 1's callback raises after step 8 (`on_train_batch_end`, outside the step): the
    exception leaves its `fit()` as Lightning raises it and that worker exits; the survivor
    meets it as a peer's fault at the next step and recovers in place with a replacement."""
    run_dir, proc = _faulted(tmp_path, "--raise-at", "8")
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    result = finish(proc, run_dir, timeout=300)
    assert "a bug in a callback, at step 8" in result.output
    assert_recovered_in_place(result, started[0]["pids"]["0"], STEPS, fault=("exception", 1))
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_a_lightning_jobs_spare_takes_the_dead_rank(tmp_path, fault_free):
    """`--spares 1`: the spare runs the script up to `fit()`, warms up in its sandbox, and on
    rank 1's death takes its slot (its rank, its sampler shard) with the survivor's state."""
    run_dir = tmp_path / "run"
    fast = tmp_path / "fast"  # steps sleep as GPU time would, until the spare has served
    proc = start(run_dir, "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "2",
                 script=SCRIPT, args=[*JOB, "--step-sleep", "1", "--sleep-until", str(fast),
                                      "--final", str(tmp_path / "faulted.pt")])
    wait_for(lambda: [e for e in events_of(run_dir, "spare_ready") if e["source"] == "worker"],
             120, "the spare to warm up", explain=run_dir)
    survivor = _kill_rank_1_after(run_dir, 1)
    wait_for(lambda: events_of(run_dir, "gen_up"), 120, "the recovery", explain=run_dir)
    fast.touch()
    result = finish(proc, run_dir, timeout=300)
    assert_recovered_in_place(result, survivor, STEPS)
    assert [e["slot"] for e in result.events("spare_promoted") if e["source"] == "worker"] == [1]
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_a_persistent_nan_is_skipped_on_every_rank(tmp_path):
    """Numerical checks on (`UnbrokenDDPStrategy(run=unbroken.init(anomalies=...))`), a NaN
    in rank 1's gradients at step 3 that comes back when the update is run again: the
    strategy checks each update after its last batch's closure, runs the update again on
    the verdict RERUN (its earlier batch from its inputs and RNG state), and on SKIPPED makes
    no update. Every rank skips step 3, no step commits a non-finite loss, and the final
    parameters equal those of a run that passed over step 3 (`run.skip_steps`, honoured at
    the update's first batch)."""
    script = SCRIPTS / "lightning_anomalies.py"
    steps, bad = 8, 3
    job = ["--steps", str(steps), "--accum", "2"]
    flags = ("--nproc-per-node", "2", "--max-restarts", "0")
    reference = launch(tmp_path / "ref", *flags, script=script, timeout=120,
                       args=["--skip-steps", str(bad), *job,
                             "--final", str(tmp_path / "reference.pt")])
    assert reference.code == 0, reference.output
    assert sorted((e["rank"], e["step"], e["reason"]) for e in reference.events("step_skipped")) \
        == [(0, bad, "asked"), (1, bad, "asked")]
    result = launch(tmp_path / "run", *flags, "--fault", f"nan:rank=1,step={bad},persistent=1",
                    script=script, timeout=120,
                    args=[*job, "--final", str(tmp_path / "faulted.pt")])
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
    _assert_same_params(tmp_path / "reference.pt", tmp_path / "faulted.pt")
