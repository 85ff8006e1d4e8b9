"""`unbroken simulate` describing the user's present setup (`--checkpoint sync`,
`--checkpoint-stall`, `--restart-min`), spares counted within `--gpus-per-node`, and the
verdict sentence printed first. Pure: no processes."""

from __future__ import annotations

import json
import re

import pytest

from unbroken.cli import main
from unbroken.errors import UserError
from unbroken.simulate.draws import draw
from unbroken.simulate.engine import Checkpoints, simulate
from unbroken.simulate.inputs import CheckpointMode, Failures, Job, Scale, Strategy
from unbroken.simulate.verdict import shares, verdict

F, S = Failures(), Scale()


def test_synchronous_checkpoints_today_go_to_the_restart_arm_and_ours_are_asynchronous():
    job = Job(gpus=64, days=30, checkpoint=CheckpointMode.SYNC, checkpoint_every_s=1800,
              checkpoint_stall_s=120)
    today = Checkpoints.for_strategy(job, S, F, Strategy.TORCHRUN)
    ours = Checkpoints.for_strategy(job, S, F, Strategy.IN_PLACE)
    assert (today.every_s, today.stall_s, today.persist_s) == (1800, 120, 0.0)
    assert ours.stall_s == pytest.approx(S.checkpoint_stall_s(job)) and ours.every_s < 1800
    draws = draw(F, job, 5, 0)
    out = simulate(draws, job, F, S, Strategy.TORCHRUN)
    stalls = out.seconds[next(c for c in out.seconds if c.value == "checkpoint_save")]
    # 120 s every 1,800 s of compute: 120 / 1,920 of the time, less what failures took
    assert float(stalls.mean()) / job.horizon_s == pytest.approx(120 / 1920, rel=0.01)


def test_without_the_new_flags_every_arm_checkpoints_as_before():
    job = Job(gpus=64)
    for strategy in Strategy:
        assert Checkpoints.for_strategy(job, S, F, strategy) == Checkpoints.for_job(job, S, F)


def test_the_restart_given_replaces_the_modelled_one():
    assert S.restart_s(Job(gpus=64, restart_s=600.0)) == 600.0
    assert S.restart_s(Job(gpus=64)) != 600.0


def test_spares_are_within_the_node_and_shown_as_reserved_capacity():
    job = Job(gpus=64, gpus_per_node=8, spares_per_node=1, standby_nodes=2)
    assert job.nodes == 8 and job.spare_nodes == 10  # 64 on 7 a node: 10 nodes
    assert job.reserved_gpus(Strategy.TORCHRUN) == job.reserved_gpus(Strategy.IN_PLACE) == 0
    assert job.reserved_gpus(Strategy.SPARES) == 80 - 64
    assert job.reserved_gpus(Strategy.SPARES_STANDBY) == 80 - 64 + 16
    assert Job(gpus=56, spares_per_node=1).reserved_gpus(Strategy.SPARES) == 8
    with pytest.raises(UserError, match="within --gpus-per-node"):
        Job(gpus=8, gpus_per_node=8, spares_per_node=8)


def _result(ck_today, fail_today, ck_ours, fail_ours, h):
    def row(ck, fail):
        return {"badput_s": {"checkpoint_save": ck * h, "infrastructure_recovery": fail * h,
                             "wasted_progress": 0.0}}
    return {"torchrun": row(ck_today, fail_today), "in_place": row(ck_ours, fail_ours)}


def test_the_verdict_says_the_figures_and_which_loss_matters():
    job = Job(gpus=64, days=30, checkpoint=CheckpointMode.SYNC)
    h = job.horizon_s
    r = _result(0.112, 0.004, 0.001, 0.0035, h)
    assert shares(r, Strategy.TORCHRUN, h) == pytest.approx((0.112, 0.004))
    assert verdict(r, job) == (
        "At 64 GPUs for 30 days, you lose 11.2 % to synchronous checkpoints and 0.4 % to "
        "failures; asynchronous checkpoints bring the first to 0.1 %; in-place recovery "
        "changes the second by less than 0.1 %: at this scale, checkpoints are what matter.")
    r = _result(0.002, 0.08, 0.002, 0.01, h)
    text = verdict(r, Job(gpus=16384, days=30))
    assert "to checkpoints and 8.0 % to failures; in-place recovery brings the second to " \
           "1.0 %: at this scale, failures are what matter." in text
    assert "asynchronous checkpoints bring" not in text  # nothing to change about them


def test_the_command_prints_the_verdict_first_then_a_table_of_at_most_100_columns(capsys):
    argv = ["simulate", "--gpus", "64", "--checkpoint", "sync", "--checkpoint-every", "30",
            "--checkpoint-stall", "120", "--days", "30", "--seeds", "10"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert re.fullmatch(r"At 64 GPUs for 30 days, you lose 6\.\d % to synchronous checkpoints "
                        r"and .* to failures; asynchronous checkpoints bring the first to .*: "
                        r"at this scale, checkpoints are what matter\.", lines[0]), lines[0]
    assert all(len(line) <= 100 for line in lines[1:]), max(lines[1:], key=len)
    assert not any("{'" in line or "': " in line for line in lines)  # no Python reprs
    header = next(line for line in lines if line.startswith("strategy"))
    assert "reserved" in header and "paid" in header
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == lines[0]
    assert data["inputs"]["reserved_gpus"] == {"torchrun": 0, "in_place": 0, "spares": 16,
                                               "spares_standby": 32}
    assert data["costs"]["today_checkpoint_stall_s"] == 120
