"""A TRL `SFTTrainer` job, unmodified (tests/scripts/trl_train.py), recovered in place under
`unbroken run` by the Hugging Face Trainer integration (TRL's trainers subclass the
`Trainer`, whose `train` the integration wraps): real worker processes, a real gloo group,
SIGKILL.

What TRL adds over a plain Trainer job: `SFTTrainer.compute_loss` gathers metrics across
ranks inside every micro-batch (a peer's death can surface there, between forward and
backward), and `SFTTrainer.__init__` prepares the dataset between barriers, which the
replacement runs before it joins (in its stand-in world).
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import SCRIPTS, assert_recovered_in_place, events_of, finish, launch, start, wait_for

pytest.importorskip("trl")

SCRIPT = SCRIPTS / "trl_train.py"
STEPS = 16
FLAGS = ("--nproc-per-node", "2", "--on-fault", "wait", "--max-restarts", "2")


def _args(tmp_path, *extra: str) -> list[str]:
    return ["--output-dir", str(tmp_path / "out"), "--steps", str(STEPS), *extra]


def test_an_sft_trainer_job_recovers_in_place(tmp_path):
    """Rank 1 is SIGKILLed from outside after step 4: the survivor keeps its process and
    its steps, the replacement (whose `SFTTrainer.__init__` ran its dataset barriers in the
    stand-in world) takes rank 1's slot with its state from the survivor."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, *FLAGS, script=SCRIPT, args=_args(tmp_path, "--step-sleep", "0.3"))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 120, "workers to start",
                       explain=run_dir)
    wait_for(lambda: any(e["step"] >= 4 for e in events_of(run_dir, "step")), 120, "step 4",
             explain=run_dir)
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    assert_recovered_in_place(finish(proc, run_dir, timeout=240), started[0]["pids"]["0"], STEPS)


def test_a_fault_met_in_sft_trainers_metric_gathers_is_recovered(tmp_path):
    """Rank 1 dies as step 6's micro-batch starts (`--fault`), after the update's item count:
    the survivor meets the fault in `SFTTrainer.compute_loss` (its metric gathers come
    before backward), and redoes the step in the new generation."""
    result = launch(tmp_path / "run", *FLAGS, "--fault", "crash:rank=1,step=6", script=SCRIPT,
                    timeout=240, args=_args(tmp_path))
    assert_recovered_in_place(result, result.events("workers_started")[0]["pids"]["0"], STEPS)
