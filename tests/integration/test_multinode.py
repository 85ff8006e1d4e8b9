"""Two agents on two hosts (network namespaces, tests/netns.py) acting as two nodes of one
job on the TCPStore: the node-0 agent serves it on its host's address, each agent keeps its
run dir on its own disk (`isolated_hosts`: no host reads another's files), and only the
checkpoint volume is shared. A test reads each node's events from that node's run dir."""

from __future__ import annotations

import os
import signal

from conftest import (
    EXAMPLE,
    TINY,
    alive,
    events_in,
    events_of,
    finish,
    run_dir_on,
    unbroken_cmd,
    wait_for,
)

from unbroken.telemetry.summary import summarize

PORT = 29500  # free in host 0's fresh namespace


def _node(hosts, node_rank, *extra, steps=40, host=None, script_args=()):
    """Node `node_rank` on host `host` (default: the node rank), reaching node 0's TCPStore
    at host 0's address; the checkpoint dir is the shared volume."""
    host = node_rank if host is None else host
    ckpt = hosts.shared_dir("ckpt")
    cmd = unbroken_cmd(
        "run", "--run-dir", str(run_dir_on(hosts, host)), "--master-addr", hosts.addr(0),
        "--master-port", str(PORT), "--nnodes", "2", "--node-rank", str(node_rank),
        "--nproc-per-node", "2", "--rdzv-id", "job", "--max-restarts", "2",
        "--node-timeout", "2", "--rdzv-timeout", "60", *extra, str(EXAMPLE),
        "--steps", str(steps), *TINY, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20",
        *script_args)
    return hosts.agent(host, cmd, shared=[ckpt])


def test_two_nodes_recover_in_place_from_a_worker_kill_on_node_1(isolated_hosts):
    """Node 1's agent publishes the death, node 0's leader plans the next generation, and
    both nodes' survivors switch to it without a restart."""
    hosts = isolated_hosts
    node0, node1 = run_dir_on(hosts, 0), run_dir_on(hosts, 1)
    fault = ["--fault", "crash:rank=3,step=11"]
    leader = _node(hosts, 0, *fault)
    follower = _node(hosts, 1, *fault)
    r1, r0 = finish(follower, node1), finish(leader, node0)
    assert r0.code == 0, r0.output
    assert r1.code == 0, r1.output
    faults = r1.events("fault")  # node 1's agent saw its worker die and said so
    assert [(f["kind"], f["rank"], f["node"], f["in_place"]) for f in faults] == [("crash", 3, 1, True)]
    started = events_in([node0, node1], "workers_started")
    # One attempt on each node (no restart); ranks 0-1 on node 0 and 2-3 on node 1.
    assert sorted((e["node"], e["attempt"]) for e in started) == [(0, 0), (1, 0)]
    assert {tuple(sorted(e["pids"])) for e in r1.events("workers_started")} == {("2", "3")}
    assert [e["world_size"] for e in r0.events("gen_plan")][0] == 3
    survivors = {int(r): pid for e in started for r, pid in e["pids"].items() if r != "3"}
    finished = {e["slot"]: e["pid"] for e in events_in([node0, node1], "training_done")}
    assert all(finished[slot] == pid for slot, pid in survivors.items()), (survivors, finished)
    s = summarize(node0)
    assert s["steps"] == 40 and s["final_loss"] < s["first_loss"] - 0.5


def test_lost_node_is_detected_the_job_shrinks_and_a_restarted_agent_ends_with_it(isolated_hosts):
    """The leader declares the node lost and the survivors go on without its ranks (shrink).
    A restarted agent for the node finds the attempt running without it: it waits, and exits
    0 with the job. (Admitting it at a step boundary is elastic growth, issue 12.)"""
    hosts = isolated_hosts
    node0, node1 = run_dir_on(hosts, 0), run_dir_on(hosts, 1)
    paced = ("--step-sleep", "0.03")  # the job outlasts the replacement's start (~12 s)
    leader = _node(hosts, 0, steps=400, script_args=paced)
    follower = _node(hosts, 1, steps=400, script_args=paced)
    wait_for(lambda: any(e.get("step", 0) >= 5 for e in events_of(node0, "step")), 120,
             "training to reach step 5", explain=node0)
    node1_workers = [e for e in events_of(node1, "workers_started") if e["node"] == 1][0]["pids"]
    os.kill(follower.pid, signal.SIGKILL)  # the whole node 1 agent dies, as with a lost machine
    follower.wait()
    # Node 0's workers see gloo errors at once, and the leader names the lost node.
    lost = wait_for(lambda: events_of(node0, "node_lost"), 30, "the leader to declare node 1 lost")
    assert lost[0]["lost_node"] == 1 and lost[0]["node"] == 0
    for pid in node1_workers.values():
        wait_for(lambda pid=pid: not alive(pid), 10, "node 1's workers to die with their agent")
    # Node 1 again, on a fresh machine (host 2: nothing of the first node 1's on its disk).
    replacement = _node(hosts, 1, steps=400, host=2, script_args=paced)
    r0, r1 = finish(leader, node0, timeout=300), finish(replacement, run_dir_on(hosts, 2), timeout=60)
    assert r0.code == 0, r0.output
    assert r1.code == 0, r1.output
    assert "job finished" in r1.output
    assert [e["world_size"] for e in r0.events("gen_plan")] == [2]
    assert summarize(node0)["steps"] == 400


def _endless_two_node_job(hosts, *extra):
    """Leader and follower of a job that trains until it is stopped."""
    leader = _node(hosts, 0, *extra, steps=100000)
    follower = _node(hosts, 1, *extra, steps=100000)
    wait_for(lambda: events_of(run_dir_on(hosts, 0), "step"), 120, "training to start",
             explain=run_dir_on(hosts, 0))
    return leader, follower


def test_with_the_tcpstore_followers_stop_when_the_leader_dies(isolated_hosts):
    """The TCPStore lives in the node-0 agent: it is the job's single point of failure
    (docs/running.md). A follower rides the loss out for --control-retry-window, then stops its
    workers and exits 3. (With etcd the job goes on: tests/integration/test_failover.py.)"""
    hosts = isolated_hosts
    leader, follower = _endless_two_node_job(hosts, "--control-retry-window", "3")
    workers = [p for e in events_in([run_dir_on(hosts, 0), run_dir_on(hosts, 1)], "workers_started")
               for p in e["pids"].values()]
    assert len(workers) == 4, workers
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    r1 = finish(follower, run_dir_on(hosts, 1), timeout=60)
    assert r1.code == 3, r1.output
    assert "retrying for up to 3s" in r1.output and "still unreachable after 3s" in r1.output
    for pid in workers:
        wait_for(lambda pid=pid: not alive(pid), 10, f"worker {pid} to stop")


def test_interrupting_the_leader_stops_every_node(isolated_hosts):
    hosts = isolated_hosts
    leader, follower = _endless_two_node_job(hosts)
    leader.send_signal(signal.SIGTERM)
    r0 = finish(leader, run_dir_on(hosts, 0), timeout=60)
    r1 = finish(follower, run_dir_on(hosts, 1), timeout=60)
    assert r0.code == 143, r0.output
    assert r1.code == 143, r1.output
    assert "the node-0 agent was interrupted" in r1.output
