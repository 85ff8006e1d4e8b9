"""The control plane on etcd, on three real "hosts" (network namespaces on one bridge,
tests/netns.py) that share nothing but the checkpoint volume: the leader's agent killed, the
leader's host cut off, a follower's blip, a standby node that keeps the ranks it took over, a
lemon node quarantined, and forged messages written straight into etcd.

Each agent runs in its host's namespace with its own address (`--local-addr`), its run dir
on its own disk (`isolated_hosts`: no host can read another's files), and the checkpoint dir
on a shared volume; etcd runs in the root namespace on the bridge. A test reads each node's
events from that node's run dir (the test itself sees every disk).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from conftest import (
    REPO,
    TINY,
    alive,
    events_in,
    events_of,
    finish,
    offered,
    run_dir_on,
    unbroken_cmd,
    wait_for,
)

from unbroken.control.auth import UNSIGNED_NOTICE
from unbroken.telemetry.summary import summarize

pytestmark = pytest.mark.usefixtures("no_process_outlives_its_test")

NODES = range(3)


def _run_dirs(hosts, *hosts_: int) -> list:
    return [run_dir_on(hosts, i) for i in (hosts_ or NODES)]


def _agent(hosts, i: int, *flags: str, node: int | None = None, steps: int = 300,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """`unbroken run` on host i, node `node` (default i), against the fixture's etcd; its run
    dir on host i's disk, the checkpoint dir on the shared volume."""
    node = i if node is None else node
    ckpt = hosts.shared_dir("ckpt")
    cmd = unbroken_cmd(
        "run", "--run-dir", str(run_dir_on(hosts, i)), "--rdzv-backend", "etcd",
        "--rdzv-endpoint", hosts.etcd.endpoint, "--local-addr", hosts.addr(i),
        "--rdzv-id", "job", "--nnodes", "2" if "--standby" in flags else "3",
        "--node-rank", str(node), "--rdzv-timeout", "60", *flags,
        str(REPO / "examples" / "gpt" / "train.py"), "--steps", str(steps), *TINY,
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", "20")
    return hosts.agent(i, cmd, shared=[ckpt], env=env)


def _three(hosts, *flags: str, steps: int = 300, env=None) -> list[subprocess.Popen]:
    return [_agent(hosts, i, *flags, steps=steps, env=env) for i in NODES]


def _at_step(run_dir, step: int, timeout: float = 120) -> None:
    wait_for(lambda: any(e.get("step", 0) >= step for e in events_of(run_dir, "step")), timeout,
             f"training to reach step {step}", explain=run_dir)


def _workers(run_dir, node: int, attempt: int = 0) -> dict[str, int]:
    """The pids of a node's workers, from that node's own run dir."""
    return next(e["pids"] for e in events_of(run_dir, "workers_started")
                if e["node"] == node and e["attempt"] == attempt)


def test_the_leaders_agent_killed_another_agent_takes_over_and_the_job_goes_on_in_place(
        isolated_hosts):
    hosts = isolated_hosts
    agents = _three(hosts, "--max-restarts", "3")
    _at_step(run_dir_on(hosts, 0), 10)
    old_workers = _workers(run_dir_on(hosts, 0), 0)
    killed_at = time.time()
    os.kill(agents[0].pid, signal.SIGKILL)  # the leader's agent, as a host dying would
    agents[0].wait()
    r1, r2 = finish(agents[1], run_dir_on(hosts, 1)), finish(agents[2], run_dir_on(hosts, 2))
    assert (r1.code, r2.code) == (0, 0), r1.output + r2.output
    survivors = _run_dirs(hosts, 1, 2)
    (elected,) = events_in(survivors, "leader_elected")
    assert elected["previous"] == 0 and elected["term"] == 1 and elected["node"] in (1, 2)
    assert elected["t"] - killed_at < 10 * 2.0  # about two lease periods; loose on 2 cores
    lost = events_in(survivors, "node_lost")
    assert [(e["node"], e["lost_node"]) for e in lost] == [(elected["node"], 0)]
    assert not events_in(_run_dirs(hosts), "restart")  # in place: the survivors kept theirs
    assert [e["world_size"] for e in events_in(survivors, "gen_plan")] == [2]
    assert summarize(run_dir_on(hosts, 1))["steps"] == 300
    for pid in old_workers.values():
        assert not alive(pid)
    # Given no secret, every agent said once that the job's control messages go unsigned.
    for r in (r1, r2, finish(agents[0], run_dir_on(hosts, 0))):
        assert r.output.count(UNSIGNED_NOTICE) == 1, r.output
        assert len(r.events("control_unsigned")) == 1


def test_the_leaders_host_cut_off_the_job_goes_on_without_it_in_place(isolated_hosts):
    """No socket closes when a link is cut: the survivors stay blocked in a collective with
    the cut-off node's worker until the new leader declares that node lost, breaks the
    generation, and their watchdogs abort it on notice (issue 13). Then in place."""
    hosts = isolated_hosts
    flags = ("--max-restarts", "3", "--recovery-timeout", "5", "--control-retry-window", "8")
    agents = _three(hosts, *flags, steps=200)
    _at_step(run_dir_on(hosts, 0), 10)
    hosts.cut(0)  # link down: no reset, packets dropped
    try:
        r1, r2 = finish(agents[1], run_dir_on(hosts, 1)), finish(agents[2], run_dir_on(hosts, 2))
        r0 = finish(agents[0], run_dir_on(hosts, 0), timeout=60)
    finally:
        hosts.heal(0)
    assert (r1.code, r2.code) == (0, 0), r1.output + r2.output
    assert r0.code == 3, r0.output  # the cut-off node gave up on the control plane
    assert "retrying for up to 8s" in r0.output
    everyone = _run_dirs(hosts)
    elected = events_in(everyone, "leader_elected")
    assert [e["previous"] for e in elected] == [0] and elected[0]["node"] in (1, 2)
    new_leader = run_dir_on(hosts, elected[0]["node"])
    assert [e["lost_node"] for e in events_in(everyone, "node_lost")] == [0]
    assert [e["lost_node"] for e in events_of(new_leader, "node_lost")] == [0]
    assert not [e for e in events_in(everyone, "rendezvous") if e["attempt"] > 0]
    assert [e["world_size"] for e in events_of(new_leader, "gen_plan")] == [2]
    # The first survivor whose watchdog aborts the broken generation shuts its sockets, so
    # the other may fail out of the collective by that peer error before its own notice.
    aborted = {e["node"] for e in events_in(everyone, "abort_on_notice")}
    assert aborted and aborted <= {1, 2}, aborted
    left = {e["node"]: e["reason"] for e in events_in(_run_dirs(hosts, 1, 2), "gen_leave")
            if e["gen"] == 0}
    assert left == {1: "peer", 2: "peer"}, left
    assert not events_in(everyone, "hang_blamed")  # alive and waiting: nobody to blame
    assert summarize(run_dir_on(hosts, 1))["steps"] == 200


def test_a_standby_node_keeps_the_ranks_it_took_over_across_a_full_restart(isolated_hosts):
    hosts = isolated_hosts
    node0, node2 = run_dir_on(hosts, 0), run_dir_on(hosts, 2)
    flags = ("--nnodes", "2", "--max-restarts", "3", "--on-fault", "wait", "--node-timeout", "3")
    a0 = _agent(hosts, 0, *flags, steps=400)
    a1 = _agent(hosts, 1, *flags, steps=400)
    standby = _agent(hosts, 2, *flags, "--standby", node=2, steps=400)
    wait_for(lambda: events_of(node2, "spare_ready"), 120, "the standby's spare", explain=node2)
    _at_step(node0, 10)
    os.kill(a1.pid, signal.SIGKILL)  # node 1 is lost; the standby's spare takes rank 1
    a1.wait()
    wait_for(lambda: events_of(node0, "gen_up"), 60, "the generation with the standby",
             explain=node0)
    # Rank 1 dies on the standby node, which starts no fresh workers, and no spare is ready
    # anywhere: under `wait` that is a full restart.
    promoted = next(e for e in events_of(node2, "spare_promoted") if e["source"] == "agent")
    os.kill(promoted["pid"], signal.SIGKILL)
    r0, r2 = finish(a0, node0), finish(standby, node2)
    assert (r0.code, r2.code) == (0, 0), r0.output + r2.output
    assert [(e["out_node"], e["by"]) for e in r0.events("node_taken_over")] == [(1, 2)]
    second = [e for e in r0.events("rendezvous") if e["attempt"] == 1]
    assert [e["nodes"] for e in second] == [[0, 2]]  # node 1 is not waited for
    assert _workers(node2, 2, attempt=1).keys() == {"1"}  # rank 1 stays on the standby
    assert summarize(node0)["steps"] == 400


def test_sigterm_to_the_leader_on_etcd_steps_it_down_and_the_job_goes_on_in_place(
        isolated_hosts):
    """A pod deletion of the leading node, on etcd, with a standby node ready: the leader
    steps down instead of ending the job; the standby node takes the lead (node 1 is given
    a long --leader-timeout, so it waits: a standby node watches the leader as any follower
    does), and the standby's spare takes its rank in place, with no restart."""
    hosts = isolated_hosts
    node0, node1, node2 = _run_dirs(hosts)
    flags = ("--nnodes", "2", "--max-restarts", "3")
    a0 = _agent(hosts, 0, *flags, steps=300)
    a1 = _agent(hosts, 1, *flags, "--leader-timeout", "60", steps=300)
    standby = _agent(hosts, 2, *flags, "--standby", node=2, steps=300)
    wait_for(lambda: offered(events_of(node2, "spares_offered")), 120,
             "the standby's spare offered", explain=node2)
    _at_step(node0, 10)
    a0.send_signal(signal.SIGTERM)
    r0 = finish(a0, node0, timeout=60)
    r1, r2 = finish(a1, node1), finish(standby, node2)
    assert r0.code == 143 and "stepping down" in r0.output, r0.output
    assert (r1.code, r2.code) == (0, 0), r1.output + r2.output
    assert [e["ranks"] for e in r0.events("leader_stepped_down")] == [1]
    assert not events_in([node0, node1, node2], "restart")  # in place: no full restart
    (elected,) = events_in([node1, node2], "leader_elected")
    assert elected["previous"] == 0 and elected["node"] == 2  # the standby node leads
    assert [e["lost_node"] for e in r2.events("node_lost")] == [0]
    promoted = [e["slot"] for e in events_of(node2, "spare_promoted") if e["source"] == "worker"]
    assert promoted == [0]
    assert summarize(node1)["steps"] == 300


def test_a_lemon_node_is_quarantined_and_its_ranks_go_to_the_standby(isolated_hosts):
    hosts = isolated_hosts
    node0, node1, node2 = _run_dirs(hosts)
    flags = ("--nnodes", "2", "--max-restarts", "5", "--quarantine-after", "2")
    a0 = _agent(hosts, 0, *flags, steps=300)
    a1 = _agent(hosts, 1, *flags, "--nproc-per-node", "2", steps=300)
    standby = _agent(hosts, 2, *flags, "--standby", "--nproc-per-node", "2", node=2, steps=300)
    # Offered, not only ready: a fault before the leader knows of a spare shrinks the world.
    wait_for(lambda: len(offered(events_of(node2, "spares_offered"))) == 2, 120,
             "the standby's two spares offered", explain=node2)
    _at_step(node0, 5)  # every worker is in its training loop: faults are taken in place
    lemon = _workers(node1, 1)
    for n, rank in enumerate(("1", "2"), start=1):  # two faults on node 1 within the window
        os.kill(lemon[rank], signal.SIGKILL)
        wait_for(lambda n=n: len(events_of(node0, "gen_up")) >= n, 60, f"recovery {n}",
                 explain=node0)
    r1 = finish(a1, node1)
    r0, r2 = finish(a0, node0), finish(standby, node2)
    assert (r0.code, r1.code, r2.code) == (0, 4, 0), r0.output + r1.output + r2.output
    assert "quarantined after repeated faults" in r1.output  # exit 4: ExitCode.QUARANTINED
    by_leader = r0.events("node_quarantined")
    assert [(e["quarantined"], e["faults"]) for e in by_leader] == [(1, 2)]
    assert [e["quarantined"] for e in r1.events("node_quarantined")] == [1]  # its own word
    faults = [(e["rank"], e["node"]) for e in r1.events("fault")]  # node 1's agent saw them
    assert faults == [(1, 1), (2, 1)], faults
    promoted = {e["slot"] for e in r2.events("spare_promoted") if e["node"] == 2}
    assert promoted == {1, 2}  # both of the lemon's ranks now run on the standby node
    assert summarize(node0)["steps"] == 300


def test_a_leader_paused_past_the_timeout_is_deposed_and_writes_nothing_after(isolated_hosts):
    """SIGSTOP on the leader's agent (a long GC pause, a frozen VM): the other node takes
    the lead and goes on in place without it. On SIGCONT the old leader's first write is
    fenced (or its first look finds the claim taken): it stands down, exit 3, and the
    job's result is the new leader's.

    Node 0's agent starts 3 s after node 1's, past the 2 s `--leader-timeout`: node 1 still
    gives it the lead (it waits up to `FIRST_CLAIM_WAIT` for node 0's claim at start)."""
    hosts = isolated_hosts
    node0, node1 = _run_dirs(hosts, 0, 1)
    flags = ("--nnodes", "2", "--max-restarts", "3")
    a1 = _agent(hosts, 1, *flags, steps=200)
    time.sleep(3.0)  # node 0's host comes up late, as pods do
    a0 = _agent(hosts, 0, *flags, steps=200)
    _at_step(node0, 10)
    os.kill(a0.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: events_of(node1, "leader_elected"), 60, "node 1 to take the lead",
                 explain=node1)
    finally:
        os.kill(a0.pid, signal.SIGCONT)
    r0 = finish(a0, node0, timeout=60)
    r1 = finish(a1, node1)
    assert r1.code == 0, r1.output
    assert r0.code == 3, r0.output
    (deposed,) = r0.events("leader_deposed")
    assert "leads now" in deposed["error"] or "leadership passed to node 1" in deposed["error"]
    (elected,) = r1.events("leader_elected")
    assert elected["previous"] == 0 and elected["term"] == 1
    assert "did not claim the lead" not in r1.output
    assert summarize(node1)["steps"] == 200


def test_forged_writes_are_rejected_and_a_follower_cut_off_for_five_seconds_is_a_blip(
        isolated_hosts):
    """One job of three nodes, signed, meets two things that must not change it:
    - someone on host 1 who can reach etcd, but has not the job's secret, writes a death and
      a plan: both are rejected and reported;
    - node 2's link is cut for 5 s: the other nodes' workers wait for node 2's in their
      collectives meanwhile, and stall, but node 2 cannot report where its worker stands and
      nobody else is behind: no kill, no fault, a blip its own agent and workers report.
    The job trains to the end untouched."""
    from unbroken.control.channel import Channel
    from unbroken.control.etcd import EtcdBackend
    from unbroken.control.messages import Fault, FaultKind, GenPlan
    from unbroken.control.schema import AttemptKeys

    hosts = isolated_hosts
    # Without a secret the job would run unsigned (and take anyone's word): give one.
    agents = _three(hosts, "--max-restarts", "2", steps=200, env={"UNBROKEN_SECRET": "ab" * 32})
    _at_step(run_dir_on(hosts, 0), 5)
    forger = Channel(EtcdBackend([hosts.etcd.endpoint], "job"))  # no secret
    keys = AttemptKeys(0)
    forged_id = forger.append(keys.deaths, Fault(kind=FaultKind.CRASH, rank=0, slot=0, wid="0.0",
                                                 node=0, attempt=0, in_place=True, detail="forged"))
    forger.write(keys.gen(1).plan, GenPlan(gen=1, members=["1.0"]))
    forger.write(keys.latest_gen, 1)
    _at_step(run_dir_on(hosts, 0), 10)
    hosts.cut(2)
    time.sleep(5)
    hosts.heal(2)
    results = [finish(a, run_dir_on(hosts, i)) for i, a in enumerate(agents)]
    assert [r.code for r in results] == [0, 0, 0], "\n".join(r.output for r in results)
    assert not any(UNSIGNED_NOTICE in r.output for r in results)
    everyone = _run_dirs(hosts)
    forged = {e["key"] for e in events_in(everyone, "forged_message")}
    assert {keys.deaths.entry_key(forged_id)} <= forged, forged
    for name in ("fault", "gen_plan", "node_lost", "restart", "leader_elected", "hang_blamed"):
        assert not events_in(everyone, name), name
    node2 = run_dir_on(hosts, 2)  # the cut-off node's own agent and workers said so
    lost = [e for e in events_of(node2, "control_plane_lost") if e["node"] == 2]
    back = [e for e in events_of(node2, "control_plane_back") if e["node"] == 2]
    assert lost and back and max(e["outage"] for e in back) >= 1.0
    for i in NODES:
        assert summarize(run_dir_on(hosts, i))["steps"] == 200


# ---------------------------------------------------------------- bad input: one line each
def _etcd_agent(tmp_path, endpoint: str, node: int, secret: str, *flags: str) -> subprocess.Popen:
    """Node `node` on loopback, in a run dir of its own (tmp_path/run-<node>)."""
    out = open(tmp_path / f"agent-{node}.out", "w+b")  # noqa: SIM115 - closed by finish()
    cmd = unbroken_cmd("run", "--run-dir", str(tmp_path / f"run-{node}"), "--rdzv-backend", "etcd",
                       "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--nnodes", "2",
                       "--node-rank", str(node), *flags, str(REPO / "examples" / "gpt" / "train.py"),
                       "--steps", "5", *TINY)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True, env=dict(os.environ, UNBROKEN_SECRET=secret))
    proc.output_file = out  # type: ignore[attr-defined]
    return proc


def test_an_unreachable_etcd_is_one_line_and_exit_3(tmp_path):
    from conftest import free_port

    r = finish(_etcd_agent(tmp_path, f"127.0.0.1:{free_port()}", 0, "aa" * 32), tmp_path / "run-0",
               timeout=60)
    assert r.code == 3, r.output
    errors = [line for line in r.output.splitlines() if "error:" in line]
    assert len(errors) == 1 and "cannot reach etcd at http://127.0.0.1:" in errors[0], r.output
    assert "is --rdzv-endpoint right?" in errors[0] and "Traceback" not in r.output


def test_an_agent_with_another_secret_is_told_so_and_cannot_take_the_lead(tmp_path, etcd_endpoint):
    run_dirs = [tmp_path / "run-0", tmp_path / "run-1"]
    leader = _etcd_agent(tmp_path, etcd_endpoint, 0, "aa" * 32, "--rdzv-timeout", "15")
    wait_for(lambda: events_of(run_dirs[0], "agent_start"), 60, "node 0 to start")
    time.sleep(1.0)  # node 0 has stood as leader
    intruder = _etcd_agent(tmp_path, etcd_endpoint, 1, "bb" * 32)
    r1 = finish(intruder, run_dirs[1], timeout=60)
    assert r1.code == 2, r1.output  # ExitCode.USAGE: permanent (docs/troubleshoot.md)
    assert "secret differs from the job's" in r1.output and "Traceback" not in r1.output
    r0 = finish(leader, run_dirs[0], timeout=60)  # node 1 never joined: node 0 says so
    assert r0.code == 3 and "node(s) [1] did not join" in r0.output, r0.output
    assert not events_in(run_dirs, "leader_elected")
