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

from unbroken.telemetry.summary import summarize

STEPS = 40
RESTART = ["--on-fault", "restart"]
ARGS = ["--steps", str(STEPS), *TINY]


def _run_with_fault(tmp_path, fault: str, workers: int = 2):
    run_dir = tmp_path / "run"
    result = launch(run_dir, "--nproc-per-node", str(workers), "--max-restarts", "2", *RESTART,
                    "--fault", fault, args=[*ARGS, "--checkpoint-dir", str(tmp_path / "ckpt"),
                                            "--checkpoint-every", "5"])
    assert result.code == 0, result.output
    return result


def _assert_recovered(result, kind: str, rank: int, step: int) -> dict:
    faults = result.events("fault")
    assert [(f["kind"], f["rank"]) for f in faults] == [(kind, rank)]
    assert faults[0]["step"] == step
    assert [e["attempt"] for e in result.events("restart")] == [1]
    summary = summarize(result.run_dir)
    assert summary["steps"] == STEPS
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    # The second attempt resumed from the last checkpoint before the fault, not from zero.
    assert_resumed_from_the_last_checkpoint(result, before_step=step)
    return faults[0]


def test_sigkill_restarts_and_completes(tmp_path):
    result = _run_with_fault(tmp_path, "crash:rank=1,step=13")
    fault = _assert_recovered(result, "crash", 1, 13)
    assert fault["exit_code"] == -signal.SIGKILL


def test_sigstop_hang_is_detected_killed_and_restarted(tmp_path):
    result = _run_with_fault(tmp_path, "hang:rank=0,step=12")
    fault = _assert_recovered(result, "hang", 0, 12)
    # Calibrated from ~tens-of-ms steps, so the 5 s floor applies: detected in seconds, not minutes.
    assert 0.9 <= fault["silent_for"] < 15, fault  # the calibrated timeout's 1 s floor


def test_exception_traceback_is_recorded(tmp_path):
    result = _run_with_fault(tmp_path, "exception:rank=1,step=17")
    fault = _assert_recovered(result, "exception", 1, 17)
    assert "InjectedFault" in fault["detail"]
    assert "Traceback (most recent call last)" in fault["traceback"]
    assert "train.py" in fault["traceback"]


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


def test_hang_blames_the_stopped_worker_among_four(tmp_path):
    """With 4 workers all blocked behind one SIGSTOPped rank, the stopped one is blamed."""
    run_dir = tmp_path / "run"
    result = launch(run_dir, "--nproc-per-node", "4", "--max-restarts", "1", *RESTART,
                    "--fault", "hang:rank=2,step=14",
                    args=["--steps", "20", *TINY, "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--checkpoint-every", "5"])
    assert result.code == 0, result.output
    assert [(f["kind"], f["rank"]) for f in result.events("fault")] == [("hang", 2)]
