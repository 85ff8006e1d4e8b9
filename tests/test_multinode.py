"""Two agents on loopback acting as two nodes of one job."""

from __future__ import annotations

import os
import signal

from conftest import TINY, alive, events_of, finish, free_port, start, wait_for

from unbroken.telemetry.summary import summarize


def _node(tmp_path, port, node_rank, *extra, steps=40, run_dir=None):
    return start(run_dir or tmp_path / "run", "--nnodes", "2", "--node-rank", str(node_rank),
                 "--nproc-per-node", "2", "--rdzv-id", "job", "--max-restarts", "2",
                 "--node-timeout", "2", "--rdzv-timeout", "60", *extra, port=port,
                 args=["--steps", str(steps), *TINY, "--checkpoint-dir", str(tmp_path / "ckpt"),
                       "--checkpoint-every", "5"])


def test_two_nodes_recover_in_place_from_a_worker_kill_on_node_1(tmp_path):
    """Node 1's agent publishes the death, node 0's leader plans the next generation, and
    both nodes' survivors switch to it without a restart."""
    port = free_port()
    fault = ["--fault", "crash:rank=3,step=11"]
    leader = _node(tmp_path, port, 0, *fault)
    follower = _node(tmp_path, port, 1, *fault)
    run_dir = tmp_path / "run"
    r1, r0 = finish(follower, run_dir), finish(leader, run_dir)
    assert r0.code == 0, r0.output
    assert r1.code == 0, r1.output
    faults = r0.events("fault")
    assert [(f["kind"], f["rank"], f["node"], f["in_place"]) for f in faults] == [("crash", 3, 1, True)]
    started = r0.events("workers_started")
    # One attempt on each node (no restart); ranks 0-1 on node 0 and 2-3 on node 1.
    assert sorted((e["node"], e["attempt"]) for e in started) == [(0, 0), (1, 0)]
    assert {tuple(sorted(e["pids"])) for e in started if e["node"] == 1} == {("2", "3")}
    assert [e["world_size"] for e in r0.events("gen_plan")][0] == 3
    survivors = {int(r): pid for e in started for r, pid in e["pids"].items() if r != "3"}
    finished = {e["slot"]: e["pid"] for e in r0.events("training_done")}
    assert all(finished[slot] == pid for slot, pid in survivors.items()), (survivors, finished)
    s = summarize(run_dir)
    assert s["steps"] == 40 and s["final_loss"] < s["first_loss"] - 0.5


def test_lost_node_is_detected_the_job_shrinks_and_a_restarted_agent_ends_with_it(tmp_path):
    """The leader declares the node lost and the survivors go on without its ranks (shrink).
    A restarted agent for the node finds the attempt running without it: it waits, and exits
    0 with the job. (Admitting it at a step boundary is elastic growth, issue 12.)"""
    port = free_port()
    run_dir = tmp_path / "run"
    leader = _node(tmp_path, port, 0, steps=400)
    follower = _node(tmp_path, port, 1, steps=400)
    wait_for(lambda: any(e.get("step", 0) >= 5 for e in events_of(run_dir, "step")), 120,
             "training to reach step 5")
    node1_workers = [e for e in events_of(run_dir, "workers_started") if e["node"] == 1][0]["pids"]
    os.kill(follower.pid, signal.SIGKILL)  # the whole node 1 agent dies, as with a lost machine
    follower.wait()
    # Node 0's workers see gloo errors at once, and the leader names the lost node.
    lost = wait_for(lambda: events_of(run_dir, "node_lost"), 30, "the leader to declare node 1 lost")
    assert lost[0]["lost_node"] == 1 and lost[0]["node"] == 0
    for pid in node1_workers.values():
        wait_for(lambda pid=pid: not alive(pid), 10, "node 1's workers to die with their agent")
    replacement = _node(tmp_path, port, 1, steps=400)  # e.g. Kubernetes restarting the pod
    r0, r1 = finish(leader, run_dir, timeout=300), finish(replacement, run_dir, timeout=60)
    assert r0.code == 0, r0.output
    assert r1.code == 0, r1.output
    assert "job finished" in r1.output
    assert [e["world_size"] for e in r0.events("gen_plan")] == [2]
    assert summarize(run_dir)["steps"] == 400


def _endless_two_node_job(tmp_path, *extra):
    """Leader, follower and run dir of a job that trains until it is stopped."""
    port = free_port()
    leader = _node(tmp_path, port, 0, *extra, steps=100000)
    follower = _node(tmp_path, port, 1, *extra, steps=100000)
    wait_for(lambda: events_of(tmp_path / "run", "step"), 120, "training to start")
    return leader, follower, tmp_path / "run"


def test_with_the_tcpstore_followers_stop_when_the_leader_dies(tmp_path):
    """The TCPStore lives in the node-0 agent: it is the job's single point of failure
    (README). A follower rides the loss out for --control-retry-window, then stops its
    workers and exits 3. (With etcd the job goes on: tests/test_failover.py.)"""
    leader, follower, run_dir = _endless_two_node_job(tmp_path, "--control-retry-window", "3")
    workers = [p for e in events_of(run_dir, "workers_started") for p in e["pids"].values()]
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    r1 = finish(follower, run_dir, timeout=60)
    assert r1.code == 3, r1.output
    assert "retrying for up to 3s" in r1.output and "still unreachable after 3s" in r1.output
    for pid in workers:
        wait_for(lambda pid=pid: not alive(pid), 10, f"worker {pid} to stop")


def test_interrupting_the_leader_stops_every_node(tmp_path):
    leader, follower, run_dir = _endless_two_node_job(tmp_path)
    leader.send_signal(signal.SIGTERM)
    r0, r1 = finish(leader, run_dir, timeout=60), finish(follower, run_dir, timeout=60)
    assert r0.code == 143, r0.output
    assert r1.code == 143, r1.output
    assert "the node-0 agent was interrupted" in r1.output
