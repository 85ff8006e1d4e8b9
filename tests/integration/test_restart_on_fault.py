"""With `--on-fault restart`, a SIGKILL, a SIGSTOP hang and an exception in one worker each
restart every worker from the last checkpoint, and the job completes with its loss going
down. This is also the path in-place recovery falls back to. Real processes, real signals,
real gloo groups."""

from __future__ import annotations

import os
import signal

from conftest import (
    TINY,
    assert_gave_up,
    assert_resumed_from_the_last_checkpoint,
    finish,
    launch,
    start,
    wait_for,
)

from unbroken.errors import ExitCode
from unbroken.telemetry.summary import summarize

STEPS = 40
RESTART = ["--on-fault", "restart"]
ARGS = ["--steps", str(STEPS), *TINY]


def test_a_kill_a_hang_and_an_exception_each_restart_from_the_last_checkpoint(tmp_path):
    """Three faults in one job, each restarting every worker: a SIGKILL of rank 1 at step
    13, a SIGSTOP of rank 0 at step 22 (a hang: detected, killed), an exception in rank 1
    at step 31. Each attempt resumes from the newest checkpoint before its fault, and the
    job completes with its loss going down."""
    faults_at = [("crash", 1, 13), ("hang", 0, 22), ("exception", 1, 31)]
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "3", *RESTART,
                    "--quarantine-after", "0",  # three faults on one node: not a lemon here
                    *(f for kind, rank, step in faults_at
                      for f in ("--fault", f"{kind}:rank={rank},step={step}")),
                    args=[*ARGS, "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--checkpoint-every", "5"])
    assert result.code == 0, result.output
    faults = result.events("fault")
    assert [(f["kind"], f["rank"], f["step"]) for f in faults] == faults_at
    assert [e["attempt"] for e in result.events("restart")] == [1, 2, 3]
    summary = summarize(result.run_dir)
    assert summary["steps"] == STEPS
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    # Every attempt resumed from the last checkpoint before its fault, not from zero.
    for attempt, (_, _, step) in enumerate(faults_at, start=1):
        assert_resumed_from_the_last_checkpoint(result, before_step=step, attempt=attempt)
    crash, hang, exception = faults
    assert crash["exit_code"] == -signal.SIGKILL
    # Calibrated from ~tens-of-ms steps, so the floor applies: detected in seconds, not minutes.
    assert 0.9 <= hang["silent_for"] < 15, hang  # the calibrated timeout's 1 s floor
    assert "InjectedFault" in exception["detail"]
    assert "Traceback (most recent call last)" in exception["traceback"]
    assert "train.py" in exception["traceback"]


def test_external_sigkill_of_a_worker(tmp_path):
    """A kill from outside the worker, at whatever step it happens to be in."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "2", "--max-restarts", "1", *RESTART,
                 args=["--steps", "60", *TINY, "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--checkpoint-every", "5"])
    from conftest import events_of

    started = wait_for(lambda: events_of(run_dir, "workers_started"), 60, "workers to start")
    victim = started[0]["pids"]["1"]
    wait_for(lambda: any(e.get("step", 0) >= 8 for e in events_of(run_dir, "step")), 90,
             "training to reach step 8")
    os.kill(victim, signal.SIGKILL)
    result = finish(proc, run_dir)
    assert result.code == 0, result.output
    faults = result.events("fault")
    assert len(faults) == 1 and faults[0]["rank"] == 1 and faults[0]["pid"] == victim
    assert faults[0]["detail"] == "killed by SIGKILL"
    assert summarize(run_dir)["steps"] == 60


def test_restart_budget_is_respected(tmp_path):
    """Two faults with --max-restarts 1: the job stops with exit 1 and says why."""
    run_dir = tmp_path / "run"
    result = launch(run_dir, "--nproc-per-node", "2", "--max-restarts", "1", *RESTART,
                    "--fault", "exception:rank=0,step=3", "--fault", "exception:rank=1,step=6",
                    args=["--steps", "20", *TINY])
    assert_gave_up(result, 1, "InjectedFault", 2)


def test_a_one_node_job_whose_node_is_quarantined_ends_with_exit_4_not_a_wait(tmp_path):
    """Two faults with --quarantine-after 2 on the only node: no node is left to train on,
    and no standby node can take the ranks. The job ends at once with exit 4 (reschedule it
    elsewhere) and one line that says why, instead of waiting for nobody."""
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "3", *RESTART,
                    "--quarantine-after", "2", "--fault", "exception:rank=0,step=3",
                    "--fault", "exception:rank=1,step=6", args=["--steps", "20", *TINY],
                    timeout=120)
    assert result.code == ExitCode.QUARANTINED, result.output
    assert [e["quarantined"] for e in result.events("node_quarantined")] == [0]
    said = [line for line in result.output.splitlines() if "no node is left to train on" in line]
    assert len(said) == 1 and "--quarantine-after" in said[0], result.output
    assert len(result.events("fault")) == 2 and [e["attempt"] for e in result.events("restart")] == [1]


def test_hang_blames_the_stopped_worker_among_four(tmp_path):
    """With 4 workers all blocked behind one SIGSTOPped rank, the stopped one is blamed."""
    run_dir = tmp_path / "run"
    result = launch(run_dir, "--nproc-per-node", "4", "--max-restarts", "1", *RESTART,
                    "--fault", "hang:rank=2,step=14",
                    args=["--steps", "20", *TINY, "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--checkpoint-every", "5"])
    assert result.code == 0, result.output
    assert [(f["kind"], f["rank"]) for f in result.events("fault")] == [("hang", 2)]
