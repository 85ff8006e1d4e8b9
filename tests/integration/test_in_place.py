"""In-place recovery: a fault in one worker does not restart the others.

Real worker processes, real gloo groups, real faults (SIGKILL from outside, SIGSTOP, an
exception, kills in the middle of a recovery). Each test checks what the issue asks: the job
finishes, survivors keep their PIDs, no full restart happens unless it must.
"""

from __future__ import annotations

import os
import random
import signal

import pytest
import torch
from conftest import (
    SCRIPTS,
    TINY,
    assert_bit_identical,
    assert_resumed_from_the_last_checkpoint,
    events_of,
    finish,
    launch,
    start,
    wait_for,
)

from unbroken.telemetry.summary import summarize

STEPS = 40
ARGS = ["--steps", str(STEPS), *TINY]


def _original_pids(result) -> dict[int, int]:
    return {int(r): pid for r, pid in result.events("workers_started")[0]["pids"].items()}


def _finishers(result) -> dict[int, int]:
    """slot -> pid of the process that finished training in that slot."""
    return {e["slot"]: e["pid"] for e in result.events("training_done")}


def _assert_in_place(result, faults: list[tuple[str, int]], replaced: set[int]) -> None:
    """Completed without a full restart; every slot not in `replaced` kept its process."""
    assert result.code == 0, result.output
    assert [(f["kind"], f["rank"]) for f in result.events("fault")] == faults
    assert all(f.get("in_place") for f in result.events("fault"))
    assert not result.events("restart"), "fell back to a full restart"
    assert result.events("gen_up"), "no generation was formed in place"
    original, finishers = _original_pids(result), _finishers(result)
    for slot, pid in original.items():
        if slot in replaced:
            # Under "shrink" a short job may end before the replacement is warm enough to join.
            assert finishers.get(slot) != pid, f"slot {slot} should have been replaced"
        else:
            assert finishers[slot] == pid, f"slot {slot} changed process: {pid} -> {finishers[slot]}"
    summary = summarize(result.run_dir)
    assert summary["steps"] == STEPS, summary


@pytest.mark.serial  # measures time: alone, never beside another test
def test_sigkill_at_a_random_step_survivors_keep_their_processes(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "3", "--max-restarts", "2", args=ARGS)
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 60, "workers to start")
    victim = started[0]["pids"]["2"]
    kill_at = random.Random().randint(5, 25)
    wait_for(lambda: any(e["step"] >= kill_at for e in events_of(run_dir, "step")), 120,
             f"training to reach step {kill_at}")
    os.kill(victim, signal.SIGKILL)
    result = finish(proc, run_dir)
    _assert_in_place(result, [("crash", 2)], replaced={2})
    fault = result.events("fault")[0]
    assert fault["pid"] == victim and fault["detail"] == "killed by SIGKILL"
    # The survivors recovered within the same attempt: one attempt, several generations.
    assert {e["attempt"] for e in result.events("step")} == {0}
    assert max(e["gen"] for e in result.events("step")) >= 1
    # Their agent sent both survivors' departures from generation 0 in one write.
    sent = [e for e in result.events("departures_sent") if e["gen"] == 0]
    assert [sorted(e["wids"]) for e in sent] == [["0.0", "1.0"]], sent
    assert sent[0]["waited"] < 2.0  # 10x the gathering window


def _state(path) -> dict:
    return torch.load(path, weights_only=True)


def _committed_data(result) -> dict[tuple[int, int], int]:
    """(step, slot) -> hash of the data committed for it; each step committed in one generation."""
    data, gens = {}, {}
    for e in result.events("step"):
        gens.setdefault(e["step"], set()).add(e["gen"])
        assert (e["step"], e["slot"]) not in data, f"step {e['step']} slot {e['slot']} committed twice"
        data[e["step"], e["slot"]] = e["data"]
    redone = {s: g for s, g in gens.items() if len(g) > 1}
    assert not redone, f"steps committed in more than one generation: {redone}"
    return data


def test_replacements_make_the_run_bit_identical_even_when_the_state_sender_dies(tmp_path):
    """World size restored by replacements (--on-fault wait): rank 1 dies at step 15, and
    rank 0, about to send the state to its replacement, dies too; another holder sends it.
    Same final model and optimizer state, bit for bit, as without the faults, and every
    step's data seen exactly once."""
    clean = launch(tmp_path / "clean", "--nproc-per-node", "4",
                   args=[*ARGS, "--exact", "--final-state", str(tmp_path / "clean.pt")])
    assert clean.code == 0, clean.output
    faulty = launch(tmp_path / "faulty", "--nproc-per-node", "4", "--max-restarts", "3",
                    "--on-fault", "wait", "--fault", "crash:rank=1,step=15",
                    "--fault", "crash:rank=0,step=0,at=send",
                    args=[*ARGS, "--exact", "--final-state", str(tmp_path / "faulty.pt")])
    _assert_in_place(faulty, [("crash", 1), ("crash", 0)], replaced={0, 1})
    # The replacements took their slots with state sent by a live peer, never shrinking
    # the world.
    assert {e["world_size"] for e in faulty.events("gen_plan")} == {4}
    sent = [e for e in faulty.events("gen_switch") if e["received_bytes"] > 0]
    assert sent and all(e["state_from"] is not None for e in sent)
    got = [e for e in faulty.events("gen_switch") if e["reason"] == "replacement"]
    assert got and got[0]["received_bytes"] > 0 and got[0]["state_from"] is not None
    assert_bit_identical(_state(tmp_path / "clean.pt"), _state(tmp_path / "faulty.pt"))
    expected = _committed_data(clean)
    assert _committed_data(faulty) == expected
    assert len(expected) == STEPS * 4


def test_a_peer_killed_between_the_reduction_and_the_update_is_refused_at_the_fence(tmp_path):
    """Rank 1 dies at step 12's update point (its gradients reduced, `at=update`), while
    rank 0 is held at the same point until its generation is aborted (`until=abort`, so the
    order holds however long the notice takes on a loaded machine): the leader breaks the generation, rank 0's
    watchdog aborts it, and at its update the fence refuses (on NCCL the update would
    otherwise have been queued behind the aborted reduction). Rank 0 leaves saying so,
    still holding step 12's state; step 12 is redone once in the next generation, and the
    run ends bit-identical to a fault-free one."""
    args = [*ARGS, "--exact"]
    clean = launch(tmp_path / "clean", "--nproc-per-node", "2",
                   args=[*args, "--final-state", str(tmp_path / "clean.pt")])
    assert clean.code == 0, clean.output
    faulty = launch(tmp_path / "faulty", "--nproc-per-node", "2", "--max-restarts", "2",
                    "--on-fault", "wait", "--fault", "crash:rank=1,step=12,at=update",
                    "--fault", "slow:rank=0,step=12,at=update,seconds=60,until=abort",
                    args=[*args, "--final-state", str(tmp_path / "faulty.pt")])
    _assert_in_place(faulty, [("crash", 1)], replaced={1})
    leave = [e for e in faulty.events("gen_leave") if e["slot"] == 0][0]
    assert leave["step"] == 12 and leave["holds_state"], leave
    assert leave["error"].startswith("UpdateRefused: generation 0 was aborted"), leave
    assert_bit_identical(_state(tmp_path / "clean.pt"), _state(tmp_path / "faulty.pt"))
    assert _committed_data(faulty) == _committed_data(clean)


def test_an_exception_a_device_error_and_a_hang_each_recover_in_place(tmp_path):
    """Three faults in one job of 3 workers, none a full restart:
    - rank 1 raises at step 10: the runtime catches it, and even the raising worker keeps
      its process;
    - rank 2 hits a sticky device error (torch.AcceleratorError) at step 20: its device
      context is broken, so unlike a script's exception the worker exits, its agent reports
      the death, and a fresh process takes its rank (issue 13);
    - rank 0 is SIGSTOPped at step 30: the hang is detected, blamed on it alone, killed and
      replaced, while the others go on in place."""
    result = launch(tmp_path / "run", "--nproc-per-node", "3", "--max-restarts", "3",
                    "--quarantine-after", "0", "--fault", "exception:rank=1,step=10",
                    "--fault", "device_error:rank=2,step=20", "--fault", "hang:rank=0,step=30",
                    args=ARGS)
    _assert_in_place(result, [("exception", 1), ("exception", 2), ("hang", 0)], replaced={0, 2})
    exception, device, hang = result.events("fault")
    assert "InjectedFault" in exception["detail"]
    assert "Traceback (most recent call last)" in exception["traceback"]
    assert "exception" in result.output and "recovered in place" in result.output
    assert device["error_class"] == "own_device" and "AcceleratorError" in device["detail"]
    own_device = [(e["slot"], e["error_class"]) for e in result.events("step_failed")
                  if e["error_class"] == "own_device"]
    assert own_device == [(2, "own_device")]
    replaced = [e["slot"] for e in result.events("replacement_started")]
    assert 2 in replaced and 1 not in replaced  # the raising worker was never replaced
    assert 0.9 <= hang["silent_for"] < 15  # the 1 s floor, loosely
    assert [e["slot"] for e in result.events("hang_blamed")] == [0]


def test_two_workers_killed_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "4", "--max-restarts", "3", args=ARGS)
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 60, "workers to start")
    wait_for(lambda: any(e["step"] >= 10 for e in events_of(run_dir, "step")), 120,
             "training to reach step 10")
    victims = [started[0]["pids"]["1"], started[0]["pids"]["2"]]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    result = finish(proc, run_dir)
    faults = sorted((f["kind"], f["rank"]) for f in result.events("fault"))
    assert faults == [("crash", 1), ("crash", 2)]
    result_faults = [(f["kind"], f["rank"]) for f in result.events("fault")]
    _assert_in_place(result, result_faults, replaced={1, 2})


def test_kill_during_a_recovery(tmp_path):
    """Rank 2 dies while the group re-forms after rank 1's death: a second plan follows.
    (The same faults under `--on-fault wait`, where the next generation has a fresh
    replacement beside survivors whose failed try had advanced torch's group-name counter,
    are `benchmarks/gpu_multi.py`'s `never_arrives`, whose dry run is
    test_gpu_multi_dry_run.py: each member names its groups from 0, or every later
    generation fails to form.)"""
    result = launch(tmp_path / "run", "--nproc-per-node", "3", "--max-restarts", "3",
                    "--fault", "crash:rank=1,step=12", "--fault", "crash:rank=2,step=0,at=join",
                    args=ARGS)
    _assert_in_place(result, [("crash", 1), ("crash", 2)], replaced={1, 2})
    injected = [e for e in result.events("fault_injected") if e["at"] == "join"]
    assert injected and injected[0]["rank"] == 2
    # The survivors went through more than one plan before a generation held, and within the
    # join bound of the failed one (the join timeout, 60 s by default, and a second).
    assert len(result.events("gen_plan")) >= 2
    up = [e["t"] for e in result.events("gen_up") if e["t"] > injected[0]["t"]]
    assert up and up[0] - injected[0]["t"] < 60 + 1, up


def test_fallback_to_full_restart_when_no_holder_is_left(tmp_path):
    """2 workers: the only holder dies while sending to the replacement. No live copy of the
    state is left, so the job restarts every worker from the last checkpoint, no hang."""
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "4",
                    "--on-fault", "wait", "--fault", "crash:rank=1,step=12",
                    "--fault", "crash:rank=0,step=0,at=send",
                    args=[*ARGS, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "5"])
    assert result.code == 0, result.output
    assert result.events("recovery_fallback"), result.output
    assert [e["attempt"] for e in result.events("restart")] == [1]
    assert_resumed_from_the_last_checkpoint(result, before_step=12)
    assert summarize(result.run_dir)["steps"] == STEPS


def test_in_place_recoveries_spend_the_restart_budget(tmp_path):
    """A fault recovered in place spends one of --max-restarts: the second exception with a
    budget of one stops the job with exit 1 and the worker's traceback."""
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--fault", "exception:rank=0,step=3", "--fault", "exception:rank=1,step=6",
                    args=["--steps", "20", *TINY])
    assert result.code == 1, result.output
    assert "giving up after 1 restart(s)" in result.output
    assert "InjectedFault" in result.output
    assert [f["kind"] for f in result.events("fault") if f.get("in_place")] == ["exception"] * 2
    assert len(result.events("gen_up")) == 1  # the first was recovered in place


def _rank_1_killed_at_step_5(tmp_path, *script_args: str):
    """ckpt_train.py on 3 workers (`script_args` added), a replacement awaited on a fault;
    rank 1 SIGKILLed from outside once a step >= 5 is logged. The finished run."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc-per-node", "3", "--max-restarts", "2", "--on-fault", "wait",
                 script=SCRIPTS / "ckpt_train.py",
                 args=["--steps", str(STEPS), *script_args, "--step-sleep", "0.05"])
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 60, "workers to start")
    wait_for(lambda: any(e["step"] >= 5 for e in events_of(run_dir, "step")), 120, "step 5")
    os.kill(started[0]["pids"]["1"], signal.SIGKILL)
    return finish(proc, run_dir)


def test_a_group_the_script_forms_itself_is_the_launchers_and_recovers_in_place(tmp_path):
    """Accelerate, Lightning and torchtitan call `init_process_group` themselves: under
    `unbroken run` that call forms a group the engine can abort, so a SIGKILL is recovered
    in place (the replacement's own call forms the stand-in world, not a second job)."""
    result = _rank_1_killed_at_step_5(tmp_path, "--own-group")
    assert not result.events("in_place_unavailable"), result.events("in_place_unavailable")
    _assert_in_place(result, [("crash", 1)], replaced={1})


def test_after_a_switch_the_old_generations_view_is_collected(tmp_path):
    """The DDP that build() made for generation 0 (its buckets, on a GPU) is gone before the
    survivors build generation 1's: nothing of the old generation is kept while the new one
    is built (the failed step's frames forgotten, cycles collected; `generations/release.py`).
    build() counts the earlier views still alive (weak references, after a collection, so
    only what is still referenced counts) and each step logs it."""
    result = _rank_1_killed_at_step_5(tmp_path, "--count-old-views")
    _assert_in_place(result, [("crash", 1)], replaced={1})
    survivors = [e for e in result.events("step") if e["rank"] in (0, 2) and e["gen"] >= 1]
    assert survivors, "no step ran after the switch"
    assert all(e["views"] >= 2 for e in survivors)  # built again in the new generation
    assert [e for e in survivors if e["old_views"] != 0] == []
    # And already while build() made the new one: the old view was not held by the failed
    # step's frames (a survivor whose backward broke in DDP's all-reduce held it there).
    assert [e for e in survivors if e["old_at_build"] != 0] == []
    broke = [e for e in result.events("gen_leave") if e["rank"] in (0, 2) and e["gen"] == 0]
    assert broke and all(e["reason"] == "peer" for e in broke), broke
    switch = [e for e in result.events("gen_switch") if e["rank"] in (0, 2)]
    assert switch and all(e["free"] >= 0.0 for e in switch)
