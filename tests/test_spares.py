"""Hot spares: a warm standby takes a failed worker's exact rank.

Real workers and spares under `unbroken run --spares`, real SIGKILLs from outside. The
worker script sleeps a little per step, as a GPU job leaves its host CPU idle, so that a
spare can warm up at idle priority beside 4 workers on 2 cores.
"""

from __future__ import annotations

import os
import signal

import torch
from conftest import SCRIPTS, events_of, finish, launch, start, wait_for

CKPT_TRAIN = SCRIPTS / "ckpt_train.py"


def _args(steps: int, final: str) -> list[str]:
    return ["--steps", str(steps), "--step-sleep", "0.05", "--exact", "--full-state", final]


def _pid(run_dir, rank: int) -> int:
    return events_of(run_dir, "workers_started")[0]["pids"][str(rank)]


def _same(a, b, where="state") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where


def test_a_spare_takes_the_failed_rank_and_the_run_stays_bit_identical(tmp_path):
    steps = 300
    clean = launch(tmp_path / "clean", "--nproc-per-node", "4", script=CKPT_TRAIN,
                   args=_args(steps, str(tmp_path / "clean.pt")))
    assert clean.code == 0, clean.output
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "4", "--spares", "1", "--max-restarts", "3",
                 script=CKPT_TRAIN, args=_args(steps, str(tmp_path / "faulty.pt")))
    ready = wait_for(lambda: events_of(run_dir, "spare_ready"), 120, "the spare to warm up")
    victim = _pid(run_dir, 1)
    os.kill(victim, signal.SIGKILL)
    result = finish(proc, run_dir)
    assert result.code == 0, result.output

    promoted = result.events("spare_promoted")
    spare = ready[0]["wid"]
    assert promoted and promoted[0]["wid"] == spare and promoted[0]["slot"] == 1
    fault = result.events("fault")[0]
    assert fault["pid"] == victim and fault["spare"] == spare
    # The spare filled rank 1 in the very next generation: the world size never changed,
    # and no replacement had to start from scratch.
    assert [e["world_size"] for e in result.events("gen_plan")] == [4]
    assert result.events("gen_plan")[0]["members"][1] == spare
    assert not result.events("replacement_started")
    # The spare was warm before the fault: its shadow steps ran on a private group.
    assert ready[0]["shadow_steps"] >= 1 and ready[0]["t"] < fault["t"]
    # The pool was refilled.
    started = [e["wid"] for e in result.events("spare_started")]
    assert len(started) == 2 and started[1] != spare
    # The spare ran rank 1's steps from the recovery on, and the end state is bit-identical.
    assert {e["slot"] for e in result.events("training_done")} == {0, 1, 2, 3}
    _same(torch.load(tmp_path / "faulty.pt", weights_only=True),
          torch.load(tmp_path / "clean.pt", weights_only=True))


def test_a_spare_that_dies_is_replaced_and_none_is_promoted_before_it_is_ready(tmp_path):
    """The spare is SIGKILLed while it warms up (a new one is started), and a worker dies
    before the new spare is ready: the survivors shrink in place, as without spares."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "3",
                 script=CKPT_TRAIN, args=["--steps", "400", "--step-sleep", "0.05"])
    first = wait_for(lambda: events_of(run_dir, "spare_started"), 120, "a spare to start")
    os.kill(first[0]["pid"], signal.SIGKILL)
    wait_for(lambda: len(events_of(run_dir, "spare_started")) >= 2, 60, "a new spare")
    assert not events_of(run_dir, "spare_ready")
    os.kill(_pid(run_dir, 1), signal.SIGKILL)
    result = finish(proc, run_dir)
    assert result.code == 0, result.output
    lost = result.events("spare_lost")
    assert lost and lost[0]["wid"] == first[0]["wid"] and lost[0]["exit_code"] == -signal.SIGKILL
    fault = result.events("fault")[0]
    assert "spare" not in fault, "a spare was promoted before it was ready"
    assert result.events("gen_plan")[0]["world_size"] == 1  # shrank, as with no spares
    assert len({e["step"] for e in result.events("step")}) == 400


def test_a_promoted_spare_that_dies_is_replaced_in_turn(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "3",
                 script=CKPT_TRAIN, args=["--steps", "500", "--step-sleep", "0.05"])
    wait_for(lambda: events_of(run_dir, "spare_ready"), 120, "the spare to warm up")
    os.kill(_pid(run_dir, 1), signal.SIGKILL)
    promoted = wait_for(lambda: [e for e in events_of(run_dir, "spare_promoted")
                                 if e["source"] == "agent"], 60, "the promotion")
    wait_for(lambda: events_of(run_dir, "gen_up"), 60, "the spare's generation")
    os.kill(promoted[0]["pid"], signal.SIGKILL)  # the spare, now rank 1, dies in turn
    result = finish(proc, run_dir)
    assert result.code == 0, result.output
    faults = result.events("fault")
    assert len(faults) == 2 and faults[1]["wid"] == promoted[0]["wid"] and faults[1]["slot"] == 1
    assert len({e["step"] for e in result.events("step")}) == 500
    assert {e["slot"] for e in result.events("training_done")} == {0, 1}
