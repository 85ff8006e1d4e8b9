"""Elastic node ranges (`--nnodes MIN:MAX`) with real agents, each on a host of its own that
shares nothing but the checkpoint volume (tests/netns.py, `isolated_hosts`): torchrun's
meaning (every node that joins trains, up to MAX; a lost node leaves the job smaller), NVRx
ft_launcher's meaning behind `--extra-nodes standby` (exactly MIN nodes train; the others
stand by and take a lost node's ranks), configuration by `PET_*` alone, and too few nodes.
No `--node-rank` anywhere: node ranks are assigned in join order, as by torchrun's c10d; the
agent on host 0, whose name is the endpoint's, serves the store and is node 0."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import (
    MASTER_PORT,
    REPO,
    TINY,
    alive,
    events_in,
    events_of,
    finish,
    finish_on,
    free_port,
    go_file,
    offered,
    run_dir_on,
    unbroken_cmd,
    wait_for,
)

from unbroken.telemetry.summary import summarize

EXAMPLE = REPO / "examples" / "gpt" / "train.py"


def _job(endpoint: str, *flags: str, steps: int, ckpt: str, pet_only: bool,
         step_sleep: float, pace: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """The argv after `unbroken run --run-dir ...` of job `el` at `endpoint`, and its PET_*
    variables; with `pet_only`, configured by PET_* variables alone, as Kubeflow's PyTorchJob
    configures torchrun."""
    job = ["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           endpoint, "--rdzv-id", "el", "--max-restarts", "2", "--node-timeout", "2",
           "--rdzv-conf", "last_call_timeout=3"]
    pet = {}
    if pet_only:
        pet = {"PET_NPROC_PER_NODE": "1", "PET_RDZV_BACKEND": "c10d",
               "PET_RDZV_ENDPOINT": endpoint, "PET_RDZV_ID": "el",
               "PET_MAX_RESTARTS": "2", "PET_RDZV_CONF": "last_call_timeout=3"}
        job = ["--node-timeout", "2"]
    args = ["--steps", str(steps), *TINY, "--checkpoint-dir", ckpt,
            "--checkpoint-every", "20", "--step-sleep", str(step_sleep), *pace]
    return [*job, *flags, str(EXAMPLE), *args], pet


def _agent(hosts, i: int, *flags: str, steps: int = 200, env: dict | None = None,
           pet_only: bool = False, step_sleep: float = 0.0) -> subprocess.Popen:
    """One `unbroken run` agent of job `el` on host i, its run dir on host i's own disk, the
    checkpoint dir on the shared volume; the endpoint is host 0's name. Its steps sleep
    `step_sleep` until the test creates `go_file(hosts)`."""
    ckpt, go = hosts.shared_dir("ckpt"), go_file(hosts)
    argv, pet = _job(f"{hosts.name(0)}:{MASTER_PORT}", *flags, steps=steps, ckpt=str(ckpt),
                     pet_only=pet_only, step_sleep=step_sleep, pace=("--sleep-until", str(go)))
    return hosts.agent(i, unbroken_cmd("run", "--run-dir", "run", *argv),
                       shared=[ckpt, go.parent], env={**pet, **(env or {})})



def _loopback_agent(tmp_path: Path, port: int, *flags: str, steps: int = 200) -> subprocess.Popen:
    """One agent of job `el` on 127.0.0.1:port, outside the hosts (a job of one agent)."""
    argv, _ = _job(f"127.0.0.1:{port}", *flags, steps=steps, ckpt=str(tmp_path / "ckpt"),
                   pet_only=False, step_sleep=0.0)
    cmd = unbroken_cmd("run", "--run-dir", str(tmp_path / "run"), *argv)
    out = open(tmp_path / f"agent-{time.monotonic_ns()}.out", "w+b")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)
    proc.output_file = out  # type: ignore[attr-defined]
    return proc


def _agent_of_node(run_dirs, node: int, attempt: int = 0) -> int:
    """The agent pid of a node: the parent of its workers."""
    started = [e for e in events_in(run_dirs, "workers_started")
               if e["node"] == node and e["attempt"] == attempt]
    worker = next(iter(started[0]["pids"].values()))
    stat = Path(f"/proc/{worker}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _steps_past(run_dir: Path, step: int):
    return lambda: any(e.get("step", 0) >= step for e in events_of(run_dir, "step"))


def test_two_agents_of_an_elastic_range_both_train_and_a_lost_one_leaves_the_job_smaller(
        isolated_hosts):
    """`--nnodes 1:3`, two agents (one configured by flags, one by PET_NNODES=1:2 and the
    other PET_* variables alone): both train; node 1's agent is SIGKILLed; the job goes on
    with the node that remains (at least MIN) and finishes."""
    hosts = isolated_hosts
    dirs = [run_dir_on(hosts, 0), run_dir_on(hosts, 1)]
    a = _agent(hosts, 0, "--nnodes", "1:3", steps=300)
    b = _agent(hosts, 1, steps=300, env={"PET_NNODES": "1:3"}, pet_only=True)
    leader_dir = dirs[0]  # host 0 serves the store: node 0
    wait_for(_steps_past(leader_dir, 5), 120, "training to reach step 5", explain=leader_dir)
    plan = events_of(leader_dir, "rendezvous")[0]
    assert plan["world_size"] == 2 and sorted(plan["nodes"]) == [0, 1]
    follower = _agent_of_node(dirs, 1)
    lost_workers = [e for e in events_in(dirs, "workers_started") if e["node"] == 1][0]["pids"]
    os.kill(follower, signal.SIGKILL)
    wait_for(lambda: events_of(leader_dir, "node_lost"), 30, "node 1 to be declared lost",
             explain=leader_dir)
    for pid in lost_workers.values():
        wait_for(lambda pid=pid: not alive(pid), 10, "node 1's workers to die with their agent")
    procs = {a.pid: a, b.pid: b}
    leader = procs.pop(_agent_of_node(dirs, 0))
    result = finish(leader, leader_dir, timeout=300)
    other = procs.popitem()[1]
    other.wait(timeout=10)
    assert result.code == 0, result.output
    assert other.returncode == -signal.SIGKILL
    assert [e["lost_node"] for e in result.events("node_lost")] == [1]
    assert summarize(dirs)["steps"] == 300


def test_with_extra_nodes_standby_min_nodes_train_and_the_third_takes_a_lost_nodes_ranks(
        isolated_hosts):
    """NVRx ft_launcher's meaning: `--nnodes 2:3 --extra-nodes standby`, three agents. Two
    train, the third stands by with a warm spare; node 1's agent is SIGKILLed and the spare
    on the standby node takes its rank: the world stays at 2."""
    hosts = isolated_hosts
    dirs = [run_dir_on(hosts, i) for i in range(3)]
    leader_dir = dirs[0]  # host 0 serves the store: node 0
    flags = ("--nnodes", "2:3", "--extra-nodes", "standby")
    a = _agent(hosts, 0, *flags, steps=400, step_sleep=0.05)  # paced until the promotion
    b = _agent(hosts, 1, *flags, steps=400, step_sleep=0.05)
    wait_for(_steps_past(leader_dir, 3), 120, "two nodes to train", explain=leader_dir)
    c = _agent(hosts, 2, *flags, steps=400, step_sleep=0.05)
    wait_for(lambda: offered(events_of(dirs[2], "spares_offered")), 120,
             "the standby node's spare offered", explain=dirs[2])
    assert [e["world_size"] for e in events_of(leader_dir, "rendezvous")] == [2]
    os.kill(_agent_of_node(dirs, 1), signal.SIGKILL)
    wait_for(lambda: [e for e in events_in(dirs, "spare_promoted") if e["source"] == "agent"],
             120, "the standby node's spare to be promoted", explain=leader_dir)
    go_file(hosts).touch()
    procs = {p.pid: p for p in (a, b, c)}
    leader = procs.pop(_agent_of_node(dirs, 0))
    result = finish(leader, leader_dir, timeout=300)
    assert result.code == 0, result.output
    promoted = events_in(dirs, "spare_promoted")  # the standby node's agent and spare say so
    assert promoted and {e["slot"] for e in promoted if e["source"] == "agent"} == {1}
    standby_node = [e["node"] for e in promoted if e["source"] == "agent"][0]
    assert standby_node == 2
    assert all(e["world_size"] == 2 for e in result.events("gen_plan"))  # never smaller
    for p in procs.values():
        p.wait(timeout=30)
    assert summarize(dirs)["steps"] == 400


def test_fewer_agents_than_min_end_with_one_clear_line_after_the_rendezvous_timeout(tmp_path):
    port = free_port()  # one agent: on loopback, outside the hosts
    proc = _loopback_agent(tmp_path, port, "--nnodes", "2:3", "--rdzv-timeout", "3")
    result = finish(proc, tmp_path / "run", timeout=60)
    assert result.code != 0
    assert "only 1 node(s) joined within 3s, fewer than the --nnodes minimum of 2" in result.output
    assert not events_of(tmp_path / "run", "workers_started")


def test_a_node_that_joins_a_running_job_stands_by_then_trains_from_the_next_restart(
        isolated_hosts):
    """`--nnodes 1:2`: the job starts alone after the last call; a second agent joins later
    and stands by; a worker crash restarts the job (`--on-fault restart`), and the restart
    gathers both nodes: the world grows from 1 to 2."""
    hosts = isolated_hosts
    node0, node1 = run_dir_on(hosts, 0), run_dir_on(hosts, 1)
    flags = ("--nnodes", "1:2", "--on-fault", "restart")
    a = _agent(hosts, 0, *flags, steps=300, step_sleep=0.05)
    wait_for(_steps_past(node0, 3), 120, "the first node to train alone", explain=node0)
    b = _agent(hosts, 1, *flags, steps=300, step_sleep=0.05)
    wait_for(lambda: [e for e in events_of(node1, "workers_started") if e["node"] == 1], 60,
             "the late node to stand by", explain=node0)
    victim = next(iter(events_of(node0, "workers_started")[0]["pids"].values()))
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: [e for e in events_of(node0, "rendezvous") if e["attempt"] == 1], 120,
             "the restart's rendezvous", explain=node0)
    go_file(hosts).touch()
    result = finish_on(hosts, 0, a, timeout=300)
    b.wait(timeout=30)
    assert result.code == 0 and b.returncode == 0, result.output
    assert [(e["attempt"], e["world_size"]) for e in result.events("rendezvous")] == [(0, 1), (1, 2)]
    late = [e for e in events_of(node1, "workers_started") if e["node"] == 1]
    assert [(e["attempt"], sorted(e["pids"])) for e in late] == [(0, []), (1, ["1"])]
