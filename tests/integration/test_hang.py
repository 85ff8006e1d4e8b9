"""Hangs, in place (issue 13): a worker SIGSTOPped mid-step on one of two nodes is the only
one killed; a long evaluation declared with `run.phase` is not a hang; a noisy step time
is not either. Real agents as two nodes on two hosts that share nothing but the checkpoint
volume (tests/netns.py, `isolated_hosts`), real gloo groups, real signals.

Speed (hang to first resumed step) is measured by benchmarks/hang.py; the bounds here are
loose, as a loaded machine must not fail them.
"""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
from conftest import (
    MASTER_PORT,
    TINY,
    events_in,
    events_of,
    finish_on,
    launch,
    run_dir_on,
    start_on,
    wait_for,
)

from unbroken.telemetry.summary import summarize

pytestmark = pytest.mark.usefixtures("no_process_outlives_its_test")


def _node(hosts, node_rank, *extra, steps):
    """Node `node_rank` on host `node_rank`, its run dir on its own disk; the checkpoint dir
    is the shared volume."""
    ckpt = hosts.shared_dir("ckpt")
    return start_on(hosts, node_rank, "--nnodes", "2", "--node-rank", str(node_rank),
                    "--master-addr", hosts.name(0), "--master-port", MASTER_PORT,
                    "--nproc-per-node", "2", "--rdzv-id", "job", "--max-restarts", "3",
                    "--rdzv-timeout", "60", *extra, shared=[ckpt],
                    args=["--steps", str(steps), *TINY, "--step-sleep", "0.05",
                          "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20"])


@pytest.mark.serial  # measures time: alone, never beside another test
def test_a_worker_stopped_mid_step_on_one_of_two_nodes_is_the_only_one_killed(isolated_hosts):
    """Rank 3 (node 1) is SIGSTOPped from outside at a random point of a step. Every rank
    stalls; the leader reads both nodes' reports, blames the stopped one, and only it dies:
    one fault, charged once, and the three others recover in place in their own processes."""
    hosts = isolated_hosts
    node0, node1 = run_dir_on(hosts, 0), run_dir_on(hosts, 1)
    leader = _node(hosts, 0, steps=150)
    follower = _node(hosts, 1, steps=150)
    wait_for(lambda: any(e.get("step", 0) >= 40 for e in events_of(node0, "step")), 120,
             "training to reach a steady state", explain=node0)
    pids = {int(r): p for e in events_in([node0, node1], "workers_started")
            for r, p in e["pids"].items()}
    stopped_at = time.time()
    os.kill(pids[3], signal.SIGSTOP)
    r0, r1 = finish_on(hosts, 0, leader), finish_on(hosts, 1, follower)
    assert (r0.code, r1.code) == (0, 0), r0.output + r1.output
    faults = events_in([node0, node1], "fault")
    assert faults == r1.events("fault")  # said by node 1's agent, whose worker it killed
    assert [(f["kind"], f["rank"], f["node"]) for f in faults] == [("hang", 3, 1)]
    assert faults[0]["in_place"] and "blamed by the leader" in faults[0]["detail"]
    assert not r1.events("hang_blamed")
    (blamed,) = r0.events("hang_blamed")
    assert (blamed["slot"], blamed["culprit_node"]) == (3, 1) and "stopped" in blamed["reason"]
    assert not events_in([node0, node1], "restart"), "fell back to a full restart"
    finishers = {e["slot"]: e["pid"] for e in events_in([node0, node1], "training_done")}
    assert all(finishers[r] == pids[r] for r in (0, 1, 2)), (pids, finishers)
    assert finishers.get(3) != pids[3]
    up = min(e["t"] for e in r0.events("gen_up"))
    timeout = faults[0]["timeout"]
    assert 0.9 <= timeout <= 3.0  # 3 x the p99 of ~60 ms steps is under the 1 s floor
    print(f"SIGSTOP to generation up: {up - stopped_at:.2f}s (hang timeout {timeout}s)")
    assert up - stopped_at < 10 * (timeout + 0.5)
    assert summarize([node0, node1])["steps"] == 150


@pytest.mark.serial  # measures time: alone, never beside another test
def test_a_noisy_step_time_and_a_declared_long_evaluation_kill_nobody(tmp_path):
    """400 steps whose time varies threefold (`--step-jitter 3`), and rank 0 evaluating
    for 3 s every 150 steps (declared with `run.phase`) while rank 1 waits in the gradient
    collective, about 60 step times. Neither is a hang: the stall is seen and reported,
    and excused; nobody is killed, nothing restarts."""
    result = launch(tmp_path / "run", "--nproc-per-node", "2", "--max-restarts", "1",
                    args=["--steps", "400", *TINY, "--step-sleep", "0.01", "--step-jitter", "3",
                          "--eval-every", "150", "--eval-seconds", "3"], timeout=600)
    assert result.code == 0, result.output
    for name in ("fault", "hang_blamed", "restart"):
        assert not result.events(name), name
    phases = result.events("phase")
    assert [(e["name"], e["step"]) for e in phases] == [("eval", 150), ("eval", 300)]
    assert all(e["duration"] >= 3.0 for e in phases)
    verdicts = [e["verdict"] for e in result.events("stall")]
    # Rank 1 stalled past its timeout and was excused; the jitter made no other stall.
    assert "excused" in verdicts and not set(verdicts) - {"excused", "wait"}, verdicts
    durations = [e["duration"] for e in result.events("step") if e["rank"] == 0]
    assert len(durations) == 400 == summarize(result.run_dir)["steps"]
    durations.sort()
    # The jitter was real: sleeps from 10 to 30 ms spread the steps by about 20 ms (a ratio
    # would shrink as a loaded machine's compute time grows; the spread does not).
    assert durations[-20] - durations[20] > 0.01, (durations[20], durations[-20])


def test_the_flight_recorder_is_dumped_by_every_rank_before_a_hang_is_cut(tmp_path):
    """Flight recorder on (`TORCH_FR_BUFFER_SIZE`): rank 1 hangs alive in its step (a 300 s
    `slow` fault: its watchdog thread still runs), ranks 0 and 2 wait for it in the gradient
    all-reduce. Before the leader's verdict kills rank 1, its agent asks it to dump (reason
    `asked`); ranks 0 and 2 dump before they leave the generation. Each dump is torch's own, with rank 0's and rank 2's last collective an all-reduce the culprit never
    joined; the job then recovers in place and finishes."""
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "64"}
    result = launch(tmp_path / "run", "--nproc-per-node", "3", "--max-restarts", "1",
                    "--hang-timeout", "3", "--fault", "slow:rank=1,step=8,seconds=300",
                    args=["--steps", "20", *TINY], env=env, timeout=300)
    assert result.code == 0, result.output
    (blamed,) = result.events("hang_blamed")
    assert blamed["slot"] == 1
    dumps = {e["rank"]: e for e in result.events("flight_recorder_dumped")}
    assert dumps[1]["reason"] == "asked" and dumps.keys() == {0, 1, 2}, dumps
    # gloo fails the survivors' all-reduce when the culprit dies (`peer`); NCCL would wait
    # until the watchdog aborts it (`abort`): either is first, once
    assert {dumps[0]["reason"], dumps[2]["reason"]} <= {"peer", "abort"}
    assert all(dumps[r]["t"] < blamed["t"] + 5 for r in dumps)
    for rank in (0, 2):
        path = result.run_dir / "node_0" / "flight_recorder" / f"rank_{rank}"
        assert dumps[rank]["path"] == str(path)
        trace = pickle.loads(path.read_bytes())  # noqa: S301 - torch's own dump, written here
        last = trace["entries"][-1]
        assert "all_reduce" in last["profiling_name"], last
    assert not result.events("restart")  # recovered in place
