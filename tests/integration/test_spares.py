"""Hot spares: a warm spare process takes a failed worker's exact rank.

Real workers and spares under `unbroken run --spares`, real SIGKILLs from outside. The
worker script sleeps a little per step, as a GPU job leaves its host CPU idle, so that a
spare can warm up at idle priority beside 4 workers on 2 cores. A job of several nodes runs
them on hosts that share nothing (tests/netns.py, `isolated_hosts`), each node with its own
run dir.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    MASTER_PORT,
    REPO,
    SCRIPTS,
    alive,
    events_in,
    events_of,
    finish,
    finish_on,
    go_file,
    launch,
    offered,
    run_dir_on,
    start,
    start_on,
    unbroken_cmd,
    wait_for,
)

from unbroken.runtime.run import _JOIN_TIMEOUT  # how long a member waits to form a generation

CKPT_TRAIN = SCRIPTS / "ckpt_train.py"


def _args(steps: int, final: str, paced: bool = True) -> list[str]:
    """A job whose final state is compared bit for bit; a failure-free one need not be paced
    (a sleep changes a step's time, never its state)."""
    pace = ["--step-sleep", "0.05"] if paced else []
    return ["--steps", str(steps), *pace, "--exact", "--full-state", final]


def _paced(fast: Path) -> list[str]:
    """Steps of 50 ms (a spare warms up at idle priority beside the workers) until the test
    creates `fast`, having seen what it waited for; then the job runs out at full speed."""
    return ["--step-sleep", "0.05", "--sleep-until", str(fast)]


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


STEPS = 300


@pytest.fixture(scope="module")
def clean_4(tmp_path_factory) -> Path:
    """The final state of a failure-free run of 4 workers, STEPS steps: what every faulty
    4-worker run of this module must end with, bit for bit (run once for the module)."""
    root = tmp_path_factory.mktemp("clean_4")
    clean = launch(root / "run", "--nproc-per-node", "4", script=CKPT_TRAIN,
                   args=_args(STEPS, str(root / "clean.pt"), paced=False))
    assert clean.code == 0, clean.output
    return root / "clean.pt"


def test_a_spare_takes_the_failed_rank_and_the_run_stays_bit_identical(tmp_path, clean_4):
    steps = STEPS
    run_dir, fast = tmp_path / "run", tmp_path / "fast"
    proc = start(run_dir, "--nproc-per-node", "4", "--spares", "1", "--max-restarts", "3",
                 script=CKPT_TRAIN,
                 args=[*_args(steps, str(tmp_path / "faulty.pt")), "--sleep-until", str(fast)])
    ready = wait_for(lambda: events_of(run_dir, "spare_ready"), 120, "the spare to warm up")
    victim = _pid(run_dir, 1)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(events_of(run_dir, "spare_started")) >= 2, 60, "the pool refilled")
    fast.touch()
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
          torch.load(clean_4, weights_only=True))


def test_a_spare_that_dies_is_replaced_and_none_is_promoted_before_it_is_ready(tmp_path):
    """The spare is SIGKILLed while it warms up (a new one is started), and a worker dies
    before the new spare is ready: the survivors shrink in place, as without spares."""
    run_dir, fast = tmp_path / "run", tmp_path / "fast"
    proc = start(run_dir, "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "3",
                 script=CKPT_TRAIN, args=["--steps", "400", *_paced(fast)])
    first = wait_for(lambda: events_of(run_dir, "spare_started"), 120, "a spare to start")
    os.kill(first[0]["pid"], signal.SIGKILL)
    wait_for(lambda: len(events_of(run_dir, "spare_started")) >= 2, 60, "a new spare")
    assert not events_of(run_dir, "spare_ready")
    os.kill(_pid(run_dir, 1), signal.SIGKILL)
    wait_for(lambda: events_of(run_dir, "gen_up"), 60, "the shrunk generation")
    fast.touch()  # seen: the rest of the job may run at full speed
    result = finish(proc, run_dir)
    assert result.code == 0, result.output
    lost = result.events("spare_lost")
    assert lost and lost[0]["wid"] == first[0]["wid"] and lost[0]["exit_code"] == -signal.SIGKILL
    fault = result.events("fault")[0]
    assert "spare" not in fault, "a spare was promoted before it was ready"
    assert result.events("gen_plan")[0]["world_size"] == 1  # shrank, as with no spares
    assert len({e["step"] for e in result.events("step")}) == 400


def test_a_promoted_spare_that_dies_is_replaced_in_turn(tmp_path):
    run_dir, fast = tmp_path / "run", tmp_path / "fast"
    proc = start(run_dir, "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "3",
                 script=CKPT_TRAIN, args=["--steps", "500", *_paced(fast)])
    wait_for(lambda: events_of(run_dir, "spare_ready"), 120, "the spare to warm up")
    os.kill(_pid(run_dir, 1), signal.SIGKILL)
    promoted = wait_for(lambda: [e for e in events_of(run_dir, "spare_promoted")
                                 if e["source"] == "agent"], 60, "the promotion")
    wait_for(lambda: events_of(run_dir, "gen_up"), 60, "the spare's generation")
    os.kill(promoted[0]["pid"], signal.SIGKILL)  # the spare, now rank 1, dies in turn
    wait_for(lambda: len(events_of(run_dir, "gen_up")) >= 2, 60, "the second recovery")
    # Then slot 1 is refilled (a new spare, or a replacement started cold) before the job
    # runs out at full speed: the world is whole again.
    wait_for(lambda: [e for e in events_of(run_dir, "gen_up")[1:] if e["world_size"] == 2],
             120, "slot 1 refilled", explain=run_dir)
    fast.touch()
    result = finish(proc, run_dir)
    assert result.code == 0, result.output
    faults = result.events("fault")
    assert len(faults) == 2 and faults[1]["wid"] == promoted[0]["wid"] and faults[1]["slot"] == 1
    assert len({e["step"] for e in result.events("step")}) == 500
    assert {e["slot"] for e in result.events("training_done")} == {0, 1}


@pytest.mark.serial  # measures time: alone, never beside another test
def test_a_drain_moves_a_rank_onto_a_spare_with_a_stall_of_about_one_step(tmp_path):
    """`unbroken drain RUN_DIR --rank 1` while the job trains: the spare takes rank 1 at a
    step boundary, the drained worker exits cleanly (no fault), and the survivors' longest
    step around the switch is about one step long (against its paced steps before it)."""
    steps = 300
    clean = launch(tmp_path / "clean", "--nproc-per-node", "2", script=CKPT_TRAIN,
                   args=_args(steps, str(tmp_path / "clean.pt"), paced=False))
    assert clean.code == 0, clean.output
    run_dir, fast = tmp_path / "run", tmp_path / "fast"
    proc = start(run_dir, "--nproc-per-node", "2", "--spares", "1", "--max-restarts", "1",
                 script=CKPT_TRAIN, args=[*_args(steps, str(tmp_path / "drained.pt"), paced=False),
                                          *_paced(fast)])
    ready = wait_for(lambda: events_of(run_dir, "spare_ready"), 120, "the spare to warm up")
    drained_pid = _pid(run_dir, 1)
    cmd = subprocess.run(unbroken_cmd("drain", str(run_dir), "--rank", "1", "--timeout", "60"),
                         capture_output=True, text=True, timeout=90, cwd=REPO)
    assert cmd.returncode == 0, cmd.stderr
    wait_for(lambda: any(e["step"] >= _switch_step(run_dir) + 3 for e in events_of(run_dir, "step")
                         if e["rank"] == 0), 60, "3 paced steps after the switch")
    fast.touch()
    assert f"moved rank 1 from worker 1.0 to spare {ready[0]['wid']}" in cmd.stdout
    result = finish(proc, run_dir)
    assert result.code == 0, result.output
    assert not result.events("fault"), "a drain is not a fault"
    (left,) = [e for e in result.events("drained") if e["source"] == "worker"]
    assert left["pid"] == drained_pid and left["slot"] == 1
    assert [e["world_size"] for e in result.events("gen_plan")] == [2]  # never shrank
    assert result.events("gen_plan")[0]["members"] == ["0.0", ready[0]["wid"]]
    # The stall: rank 0's longest step interval around the switch, against its median step.
    times = sorted((e["step"], e["t"]) for e in result.events("step") if e["rank"] == 0
                   and e["slot"] == 0)
    gaps = [b[1] - a[1] for a, b in zip(times, times[1:], strict=False)]
    switch_step = left["step"]
    paced = sorted(g for (s, _), g in zip(times[1:], gaps, strict=False) if s < switch_step - 2)
    median = paced[len(paced) // 2]
    around = [g for (s, _), g in zip(times[1:], gaps, strict=False) if abs(s - switch_step) <= 2]
    stall = max(around) - median
    print(f"drain: median step {median * 1000:.0f} ms, stall {stall * 1000:.0f} ms")
    assert stall < 3 * median + 0.05, (stall, median)
    # Bit-identical to the run without a drain: the spare got the exact state of rank 1.
    _same(torch.load(tmp_path / "drained.pt", weights_only=True),
          torch.load(tmp_path / "clean.pt", weights_only=True))


def test_a_peer_killed_in_a_drains_teardown_fails_over_within_the_join_bound(tmp_path):
    """A drain moves rank 1 onto a spare; rank 2 is SIGKILLed in the drain's teardown (its
    device drained, its old groups not yet torn down: `at=teardown`). The planned switch
    becomes a fault switch at the same committed step: the second spare takes rank 2, rank
    0 reaches the next generation within the worker's join bound + 1 s of the kill, and the
    job ends bit-identical to a run with neither the drain nor the kill."""
    steps = 200
    clean = launch(tmp_path / "clean", "--nproc-per-node", "3", script=CKPT_TRAIN,
                   args=_args(steps, str(tmp_path / "clean.pt"), paced=False))
    assert clean.code == 0, clean.output
    run_dir, fast = tmp_path / "run", tmp_path / "fast"
    proc = start(run_dir, "--nproc-per-node", "3", "--spares", "2", "--max-restarts", "1",
                 "--fault", "crash:rank=2,step=0,at=teardown",
                 script=CKPT_TRAIN, args=[*_args(steps, str(tmp_path / "final.pt"), paced=False),
                                          *_paced(fast)])
    wait_for(lambda: len(events_of(run_dir, "spare_ready")) == 2, 120, "both spares to warm up")
    cmd = subprocess.run(unbroken_cmd("drain", str(run_dir), "--rank", "1", "--timeout", "60"),
                         capture_output=True, text=True, timeout=90, cwd=REPO)
    wait_for(lambda: any(e["step"] >= _switch_step(run_dir) + 3 for e in events_of(run_dir, "step")
                         if e["rank"] == 0), 60, "3 paced steps after the switch")
    fast.touch()
    result = finish(proc, run_dir)
    assert result.code == 0, result.output
    (killed,) = [e for e in result.events("fault_injected") if e["at"] == "teardown"]
    assert killed["rank"] == 2 and killed["kind"] == "crash"
    # Both ranks refilled from the spares: the job never shrank, and nobody restarted.
    assert not result.events("restart")
    assert {e["world_size"] for e in result.events("gen_plan")} == {3}
    promoted = [e for e in result.events("spare_promoted") if e["source"] == "agent"]
    assert len(promoted) == 2, (promoted, cmd.stdout, cmd.stderr)
    # Rank 0, a survivor, in the generation that holds: within the join bound of the kill.
    (rank0,) = [e for e in result.events("gen_switch") if e["slot"] == 0]
    assert rank0["step"] == killed["step"], "the same committed step: nothing redone, none lost"
    took = rank0["t"] - killed["t"]
    print(f"teardown kill: rank 0 in generation {rank0['gen']} {took:.2f} s after it "
          f"({rank0['tries']} tries)")
    assert took < _JOIN_TIMEOUT + 1.0, took
    _same(torch.load(tmp_path / "final.pt", weights_only=True),
          torch.load(tmp_path / "clean.pt", weights_only=True))


def _switch_step(run_dir) -> float:
    """The step at which the drained worker left (infinity until it has)."""
    left = [e["step"] for e in events_of(run_dir, "drained") if e["source"] == "worker"]
    return left[0] if left else float("inf")


def _standby_job(hosts, *flags: str, args: list[str]) -> tuple[list, Path]:
    """Nodes 0 and 1 of 2 workers each and a standby node 2 (`flags` each), node k on host k,
    paced until the test creates the returned file (on a volume every host sees)."""
    fast = go_file(hosts)

    def node(rank: int, *extra: str):
        return start_on(hosts, rank, "--nnodes", "2", "--node-rank", str(rank),
                        "--master-addr", hosts.name(0), "--master-port", MASTER_PORT,
                        "--nproc-per-node", "2", "--rdzv-id", "job", *flags, *extra,
                        script=CKPT_TRAIN, args=[*args, "--sleep-until", str(fast)],
                        shared=[fast.parent])

    return [node(0), node(1), node(2, "--standby")], fast


def test_a_standby_node_takes_over_a_lost_node_in_place(isolated_hosts, clean_4):
    """Two nodes of 2 workers and a standby node, on three hosts. Node 1's agent is SIGKILLed,
    as with a lost machine: its workers die with it, the standby's warm spares take ranks 2
    and 3 in place, the world size stays 4 and the run ends bit-identical."""
    hosts = isolated_hosts
    steps = STEPS
    node0, node1, node2 = (run_dir_on(hosts, k) for k in range(3))
    faulty = hosts.node_dir(0) / "faulty.pt"  # rank 0 writes it, on node 0's disk
    (leader, follower, standby), fast = _standby_job(
        hosts, "--max-restarts", "3", "--node-timeout", "1", args=_args(steps, str(faulty)))
    try:
        ready = wait_for(lambda: len(events_of(node2, "spare_ready")) >= 2 and
                         events_of(node2, "spare_ready"), 120, "the standby's spares to warm up",
                         explain=node2)
        wait_for(lambda: len(offered(events_of(node2, "spares_offered"))) == 2, 60,
                 "the standby's spares offered", explain=node2)
        # In steady state: on a loaded machine the spares can be warm before the workers
        # have built DDP, and a node lost then is a fault before the in-place loop runs.
        wait_for(lambda: any(e["step"] >= 3 for e in events_of(node0, "step")), 120,
                 "training to reach step 3", explain=node0)
        lost_workers = [e for e in events_of(node1, "workers_started") if e["node"] == 1][0]["pids"]
        os.kill(follower.pid, signal.SIGKILL)
        follower.wait()
        wait_for(lambda: events_of(node0, "gen_up"), 60, "the standby's generation", explain=node0)
        fast.touch()
        result = finish_on(hosts, 0, leader)
        assert result.code == 0, result.output
        assert finish_on(hosts, 2, standby, timeout=30).code == 0
    finally:
        for p in (leader, follower, standby):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for pid in lost_workers.values():
        assert not alive(pid)
    everyone = [node0, node1, node2]
    (lost,) = result.events("node_lost")
    assert lost["lost_node"] == 1
    faults = result.events("fault")  # the lost node's ranks are the leader's to report
    assert sorted(f["slot"] for f in faults) == [2, 3] and all(f["in_place"] for f in faults)
    assert sorted(f["slot"] for f in events_in(everyone, "fault")) == [2, 3]
    assigned = {e["slot"]: e["wid"] for e in result.events("spare_assigned")}
    assert set(assigned) == {2, 3} and set(assigned.values()) == {e["wid"] for e in ready}
    assert all(e["spare_node"] == 2 for e in result.events("spare_assigned"))
    assert not events_in(everyone, "restart") and not events_in(everyone, "recovery_fallback")
    plans = result.events("gen_plan")
    assert [p["world_size"] for p in plans] == [4]
    assert plans[0]["members"] == ["0.0", "1.0", assigned[2], assigned[3]]
    assert {e["slot"] for e in events_in(everyone, "training_done")} == {0, 1, 2, 3}
    _same(torch.load(faulty, weights_only=True), torch.load(clean_4, weights_only=True))


def test_draining_a_node_moves_its_ranks_to_a_standby_node_and_its_agent_leaves(isolated_hosts):
    hosts = isolated_hosts
    node0, node1, node2 = everyone = [run_dir_on(hosts, k) for k in range(3)]
    (leader, follower, standby), fast = _standby_job(
        hosts, "--max-restarts", "1", args=["--steps", "250", "--step-sleep", "0.2"])
    # Paced until `fast`: 250 steps of 0.2 s are 50 s for the spares to warm up and the drain
    # to finish (12.5 s at 0.05 s was at the margin); after `fast` the steps run unpaced.

    def drain(*flags: str):
        """`unbroken drain` by the run dir, on the leader's host."""
        return hosts.run(0, unbroken_cmd("drain", str(node0), *flags), 90)

    try:
        wait_for(lambda: len(offered(events_of(node2, "spares_offered"))) == 2, 120,
                 "the standby's spares offered", explain=node2)
        refused = drain("--node", "0")
        assert refused.returncode != 0 and "node 0 hosts the control store (the embedded TCPStore)" in refused.stderr
        cmd = drain("--node", "1", "--timeout", "60")
        assert cmd.returncode == 0, cmd.stderr
        assert "moved rank 2" in cmd.stdout and "moved rank 3" in cmd.stdout
        drained_agent = finish_on(hosts, 1, follower, timeout=30)  # leaves while the job goes on
        assert drained_agent.code == 5, drained_agent.output  # drained: not the job done
        assert not events_in(everyone, "training_done")
        fast.touch()
        result = finish_on(hosts, 0, leader)
        assert result.code == 0, result.output
        assert finish_on(hosts, 2, standby, timeout=30).code == 0
    finally:
        for p in (leader, follower, standby):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert not events_in(everyone, "fault") and not events_in(everyone, "node_lost")
    assert [e["node"] for e in drained_agent.events("node_drained")] == [1]  # its agent's word
    left = [e for e in events_of(node1, "drained") if e["source"] == "worker"]
    assert sorted(e["slot"] for e in left) == [2, 3]  # node 1's workers, in node 1's dir
    assert [p["world_size"] for p in result.events("gen_plan")] == [4]
    done = {e["slot"]: e["node"] for e in events_in(everyone, "training_done")}
    assert done == {0: 0, 1: 0, 2: 2, 3: 2}
    assert len({e["step"] for e in events_in(everyone, "step")}) == 250
