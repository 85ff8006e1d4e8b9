"""A Lightning job, unmodified (examples/lightning/train.py, `strategy="ddp"`), recovered in
place by the integration under `unbroken run`: real worker processes, a real gloo group,
SIGKILL. The job saves no checkpoint: the replacement's state can only come from a peer.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import REPO, assert_recovered_in_place, events_of, finish, launch, start, wait_for

pytest.importorskip("lightning")

SCRIPT = REPO / "examples" / "lightning" / "train.py"
STEPS = 30  # 12 batches an epoch: the fault lands in the first, the job ends in the third
FLAGS = ("--nproc-per-node", "2", "--on-fault", "wait", "--max-restarts", "2")


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
    """The final parameters of the job without a fault, validating every 5 batches."""
    tmp = tmp_path_factory.mktemp("clean")
    clean = launch(tmp / "run", *FLAGS, script=SCRIPT, timeout=300,
                   args=["--steps", str(STEPS), "--val-every", "5",
                         "--final", str(tmp / "clean.pt")])
    assert clean.code == 0, clean.output
    return tmp / "clean.pt"


def _faulted(tmp_path, *extra: str):
    run_dir = tmp_path / "run"
    proc = start(run_dir, *FLAGS, script=SCRIPT,
                 args=["--steps", str(STEPS), "--val-every", "5",
                       "--final", str(tmp_path / "faulted.pt"), *extra])
    return run_dir, proc


def test_a_lightning_fit_recovers_in_place_and_ends_bit_identical_to_a_fault_free_run(
        tmp_path, fault_free):
    """Two workers, rank 1 SIGKILLed mid-epoch, `--on-fault wait`: the survivor stays in
    `fit()`, the replacement takes the model, optimizer (momentum), LR scheduler and loops
    from it, skips the batches already trained, and the final parameters equal those of a run
    without the fault, bit for bit (two ranks' sums are exact)."""
    run_dir, proc = _faulted(tmp_path, "--step-sleep", "0.2")
    survivor = _kill_rank_1_after(run_dir, 6)
    result = finish(proc, run_dir, timeout=300)
    assert_recovered_in_place(result, survivor, STEPS)
    _assert_same_params(fault_free, tmp_path / "faulted.pt")


def test_a_fault_during_validation_is_recovered_at_the_next_step(tmp_path, fault_free):
    """Rank 1 dies while both validate (after step 4): the survivor's epoch-end `sync_dist`
    reduce fails, gives its local value, and the next step recovers in place."""
    run_dir, proc = _faulted(tmp_path, "--val-sleep", "0.6")
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    wait_for(lambda: any(e["step"] >= 4 for e in events_of(run_dir, "step")), 120, "step 4",
             explain=run_dir)
    time.sleep(0.3)  # inside the first validation's first batch
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    result = finish(proc, run_dir, timeout=300)
    assert "a Lightning collective outside a step" in result.output
    assert_recovered_in_place(result, started[0]["pids"]["0"], STEPS)
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
                 script=SCRIPT, args=["--steps", str(STEPS), "--val-every", "5",
                                      "--step-sleep", "1", "--sleep-until", str(fast),
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
