"""A training loop of the user's own, recovered in place by `run.steps(data=...)` and
`with run.try_step():` (examples/custom_loop/train.py, unchanged).

Real workers and a spare under `unbroken run`, real gloo groups, real SIGKILLs: at a step's
start, from outside in the middle of a step, between two micro-batches of an accumulated
step, after `optimizer.step()` inside the block, and just before the loop's own all-reduce
of the loss (after the update). The job ends bit-identical to a fault-free run (model,
optimizer and LR scheduler), every step's batch is the one the fault-free run drew for it,
and the rank never killed keeps its process.
"""

from __future__ import annotations

import os
import signal

import torch
from conftest import REPO, assert_bit_identical, events_of, finish, launch, start, wait_for

from unbroken.telemetry.summary import summarize

SCRIPT = REPO / "examples" / "custom_loop" / "train.py"
STEPS = 36


def _args(tmp_path, name: str, *extra: str) -> list[str]:
    return ["--steps", str(STEPS), "--exact", "--reduce-loss", "--print-every", "1000",
            "--final-state", str(tmp_path / f"{name}.pt"), *extra]


def _committed(result) -> dict[tuple[int, int], int]:
    """(step, slot) -> the CRC of its batch; each committed once."""
    data: dict[tuple[int, int], int] = {}
    for e in result.events("step"):
        assert (e["step"], e["slot"]) not in data, f"step {e['step']} slot {e['slot']} twice"
        data[e["step"], e["slot"]] = e["data"]
    return data


def test_a_custom_ddp_loop_recovers_every_kind_of_kill_in_place_bit_identical(tmp_path):
    clean = launch(tmp_path / "clean", "--nproc-per-node", "3",
                   script=SCRIPT, args=_args(tmp_path, "clean"))
    assert clean.code == 0, clean.output
    marker = tmp_path / "died"
    run_dir = tmp_path / "faulty"
    # Five faults on one node by design: quarantine (3 by default) would take the node away
    # after the third, and a fault that came before the next spare was ready (a loaded CI
    # run) then had no node to start a replacement on, and the job ended. Not this test's
    # subject: tests/integration/test_failover.py quarantines a lemon node.
    proc = start(run_dir, "--nproc-per-node", "3", "--spares", "1", "--on-fault", "wait",
                 "--quarantine-after", "0",
                 "--max-restarts", "8", "--fault", "crash:rank=1,step=4", script=SCRIPT,
                 args=_args(tmp_path, "faulty", "--step-sleep", "0.05",
                            "--die-marker", str(marker),
                            "--die-at", "12:2:micro", "--die-at", "20:1:update",
                            "--die-at", "28:2:reduce"))
    started = wait_for(lambda: events_of(run_dir, "workers_started"), 60, "workers to start")
    original = {int(r): pid for r, pid in started[0]["pids"].items()}
    # From outside, in the middle of a step (its 50 ms sleep), once the first recovery is over.
    wait_for(lambda: [e for e in events_of(run_dir, "step") if e["step"] >= 7 and e["slot"] == 1],
             120, "slot 1 to reach step 7", explain=run_dir)
    os.kill(_pid_of_slot(run_dir, 1), signal.SIGKILL)
    faulty = finish(proc, run_dir, timeout=300)
    assert faulty.code == 0, faulty.output

    faults = faulty.events("fault")
    assert len(faults) == 5 and all(f.get("in_place") for f in faults), faults
    assert not faulty.events("restart"), "fell back to a full restart"
    assert not faulty.events("in_place_unavailable"), faulty.events("in_place_unavailable")
    assert faulty.events("spare_promoted"), "no spare took a rank"
    finishers = {e["slot"]: e["pid"] for e in faulty.events("training_done")}
    assert finishers[0] == original[0], "the rank never killed changed its process"
    assert_bit_identical(torch.load(tmp_path / "clean.pt", weights_only=True),
                         torch.load(tmp_path / "faulty.pt", weights_only=True))
    # Every step's batch is the fault-free run's. A step some rank committed before a fault
    # is never computed again: a rank killed after its update (inside its block) had not yet
    # written the step's event (written as the try ends), and a survivor whose update the
    # fence refused received the state of that step from the peer that committed it. Either
    # way the step's other events stand and the next generation starts after it.
    expected, got = _committed(clean), _committed(faulty)
    assert {k: v for k, v in expected.items() if k in got} == got
    missing = set(expected) - set(got)
    starts = {e["step"] for e in faulty.events("gen_switch")}
    assert {(20, 1), (28, 2)} <= missing and len(missing) <= 2 * len(faults), sorted(missing)
    for step, _slot in missing:
        assert step + 1 in starts and any((step, s) in got for s in range(3)), sorted(missing)
    assert summarize(faulty.run_dir)["steps"] == STEPS


def _pid_of_slot(run_dir, slot: int) -> int:
    """The pid now training in `slot`: its newest worker to start in it, or spare promoted."""
    took = [e for e in events_of(run_dir, "worker_start") if e["slot"] == slot]
    took += [e for e in events_of(run_dir, "spare_promoted")
             if e["slot"] == slot and e["source"] == "agent"]
    return max(took, key=lambda e: e["t"])["pid"]


def test_a_loader_that_cannot_be_positioned_is_said_and_the_job_restarts(tmp_path):
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "2",
                    "--fault", "crash:rank=1,step=5", script=SCRIPT,
                    args=["--steps", "10", "--iterable", "--print-every", "1000"])
    assert result.code == 0, result.output
    said = result.events("in_place_unavailable")
    assert said and "not a torch DataLoader" in said[0]["reason"], said
    assert "not a torch DataLoader" in result.output
    assert result.events("restart"), "the fault should have restarted every worker"


def test_a_custom_hsdp_loop_killed_takes_the_dead_ranks_shard_from_its_replica(tmp_path):
    """FSDP2 as HSDP 2 x 2 in the user's own loop: rank 1 killed mid-step between two
    micro-batches; its shard comes from rank 3, its live replica, at the committed step."""
    args = ["--hsdp", "2", "--steps", "24", "--print-every", "1000"]
    clean = launch(tmp_path / "clean", "--nproc-per-node", "4", script=SCRIPT,
                   args=[*args, "--final-state", str(tmp_path / "clean.pt")], timeout=300)
    assert clean.code == 0, clean.output
    faulty = launch(tmp_path / "faulty", "--nproc-per-node", "4", "--max-restarts", "3",
                    script=SCRIPT, timeout=300,
                    args=[*args, "--final-state", str(tmp_path / "faulty.pt"),
                          "--die-at", "12:1:micro", "--die-marker", str(tmp_path / "died")])
    assert faulty.code == 0, faulty.output
    assert not faulty.events("restart") and not faulty.events("in_place_unavailable")
    syncs = faulty.events("shard_sync")
    assert {e["step"] for e in syncs} == {12}, syncs  # the committed step: nothing redone
    assert all(e["transfers"] == [[3, 1, True]] for e in syncs), syncs
    assert_bit_identical(torch.load(tmp_path / "clean.pt", weights_only=True),
                         torch.load(tmp_path / "faulty.pt", weights_only=True))
    assert {k: v for k, v in _committed(clean).items() if k in _committed(faulty)} \
        == _committed(faulty)


def test_a_compiled_model_redoes_its_step_after_a_peers_fault(tmp_path):
    """`torch.compile(DDP(model), backend="aot_eager")`: the DDP under the compiled wrapper is
    rebuilt in place on the new group; the redone step runs through the compiled code."""
    args = ["--compile", "--exact", "--steps", "16", "--print-every", "1000"]
    clean = launch(tmp_path / "clean", "--nproc-per-node", "2", script=SCRIPT,
                   args=[*args, "--final-state", str(tmp_path / "clean.pt")], timeout=300)
    assert clean.code == 0, clean.output
    faulty = launch(tmp_path / "faulty", "--nproc-per-node", "2", "--max-restarts", "3",
                    "--on-fault", "wait", "--fault", "crash:rank=1,step=8", script=SCRIPT,
                    timeout=300, args=[*args, "--final-state", str(tmp_path / "faulty.pt")])
    assert faulty.code == 0, faulty.output
    assert not faulty.events("restart") and faulty.events("gen_switch")
    survivor = {e["pid"] for e in faulty.events("training_done") if e["slot"] == 0}
    assert survivor == {faulty.events("workers_started")[0]["pids"]["0"]}
    assert_bit_identical(torch.load(tmp_path / "clean.pt", weights_only=True),
                         torch.load(tmp_path / "faulty.pt", weights_only=True))


ACCELERATE = REPO / "examples" / "accelerate" / "train.py"


def test_an_accelerate_loop_killed_is_recovered_in_place_by_a_spare(tmp_path):
    """`Accelerator.prepare`'d model, optimizer, loader (shuffled, seedable) and scheduler in
    the user's loop: rank 1 SIGKILLed from outside once the spare is ready; the spare takes
    its rank and its place in the prepared loader, and the job ends bit-identical."""
    faulty, clean = _killed_with_a_spare(tmp_path, ACCELERATE, ["--steps", "40", "--exact"],
                                         kills=(12,))
    assert faulty.code == 0, faulty.output
    assert not faulty.events("restart") and not faulty.events("in_place_unavailable")
    assert [e["slot"] for e in faulty.events("spare_promoted") if e["source"] == "agent"] == [1]
    assert_bit_identical(torch.load(tmp_path / "clean.pt", weights_only=True),
                         torch.load(tmp_path / "faulty.pt", weights_only=True))
    got = _committed(faulty)
    assert {k: v for k, v in _committed(clean).items() if k in got} == got


def test_a_stateful_loader_whose_ranks_differ_is_placed_from_the_ranks_mark(tmp_path):
    """torchdata's `StatefulDataLoader` over a per-rank stream (`RankStream`: after the same
    number of batches the ranks stand at different places). Rank 1 is SIGKILLed twice from
    outside, and a spare takes it each time (the pool warms a new one); each loads rank 1's
    newest mark from the control store, never rank 0's or the loader's first state, and the job ends bit-identical,
    every step on the fault-free run's batch."""
    faulty, clean = _killed_with_a_spare(
        tmp_path, SCRIPT, ["--stateful", "--steps", "40", "--exact", "--print-every", "1000"],
        kills=(12, 24))
    assert faulty.code == 0, faulty.output
    assert not faulty.events("restart") and not faulty.events("in_place_unavailable")
    took = [e["slot"] for e in faulty.events("spare_promoted") if e["source"] == "agent"]
    assert took and set(took) == {1}, took
    placed = [e for e in faulty.events("loader_positioned") if e["slot"] == 1]
    assert len(placed) == 2 and all(e["mark"] == "store" for e in placed), placed
    assert not faulty.events("loader_mark_unpublished")
    assert_bit_identical(torch.load(tmp_path / "clean.pt", weights_only=True),
                         torch.load(tmp_path / "faulty.pt", weights_only=True))
    got = _committed(faulty)
    assert {k: v for k, v in _committed(clean).items() if k in got} == got
    assert summarize(faulty.run_dir)["steps"] == 40


def _killed_with_a_spare(tmp_path, script, args: list[str], kills: tuple[int, ...]):
    """A fault-free run of 2 workers, then one with a spare in which slot 1 is SIGKILLed from
    outside once at or past each step of `kills`: (the faulty result, the clean result).
    The job waits before step 10 until the spare is ready (it warms up on idle CPU)."""
    clean = launch(tmp_path / "clean", "--nproc-per-node", "2", script=script,
                   args=[*args, "--final-state", str(tmp_path / "clean.pt")])
    assert clean.code == 0, clean.output
    run_dir, go = tmp_path / "faulty", tmp_path / "go"
    proc = start(run_dir, "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "4",
                 script=script, args=[*args, "--step-sleep", "0.05", "--hold-at", "10",
                                      "--hold-file", str(go),
                                      "--final-state", str(tmp_path / "faulty.pt")])
    wait_for(lambda: events_of(run_dir, "spare_ready"), 120, "the spare to be ready",
             explain=run_dir)
    go.touch()
    for at in kills:
        wait_for(lambda at=at: [e for e in events_of(run_dir, "step")
                                if e["step"] >= at and e["slot"] == 1],
                 120, f"slot 1 at step {at}", explain=run_dir)
        os.kill(_pid_of_slot(run_dir, 1), signal.SIGKILL)
    return finish(proc, run_dir, timeout=300), clean
