"""Nodes that share nothing, as two pods or two machines have them: each node runs in its own
network namespace and its own mount namespace (tests/netns.py, the `isolated_hosts`
fixture), with its own working and run directory, so that any read of a file another node
wrote fails. Only where a test says so do the nodes share a checkpoint volume.

What is shown: torchrun's own two-node command lines (static and c10d) under both launchers
with no secret; a node with another secret leaves alone and the job finishes; a node-local
checkpoint_dir is named at the first save and nothing is committed, and `unbroken drain
RUN_DIR` works from a follower's host; a master name that resolves late; SIGTERM to a
training node's agent hands its ranks to a standby node in place; `unbroken drain` from
another host after a leader failover, on etcd; node 0, leading on etcd, drained (the lead
moves first).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    EXAMPLE,
    SCRIPTS,
    TINY,
    Launched,
    events_of,
    finish,
    finish_on,
    go_file,
    offered,
    run_dir_on,
    start_on,
    unbroken_cmd,
    wait_for,
)

from unbroken.telemetry.summary import summarize

pytestmark = pytest.mark.usefixtures("no_process_outlives_its_test")

PORT = "29500"  # every host is a namespace of its own: the port is free on each
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
UNSIGNED = "control messages are not signed"


def _train(steps: int, *extra: str) -> list[str]:
    return [str(EXAMPLE), "--steps", str(steps), *TINY, *extra]


def _events(hosts, i: int, name: str) -> list[dict]:
    """Host i's events (the test process sees every host's disk; the hosts do not)."""
    return events_of(run_dir_on(hosts, i), name)


def _unbroken(hosts, i: int, *flags: str, steps: int = 20, script_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None, shared=(), run_dir: str = "run",
              ) -> subprocess.Popen:
    """`unbroken run` on host i, from its own directory, with its own run dir."""
    return start_on(hosts, i, "--nproc-per-node", "1", "--rdzv-timeout", "60", *flags,
                    args=_train(steps, *script_args)[1:], env=env, shared=shared,
                    run_dir=run_dir)


def _done(hosts, i: int, proc: subprocess.Popen, timeout: float = 180,
          run_dir: str = "run") -> Launched:
    return finish_on(hosts, i, proc, timeout, run_dir)


def _paced(hosts) -> tuple[tuple[str, ...], list[Path], Path]:
    """Steps of 50 ms, so that the job lasts through what the test waits for (a spare's
    warm-up, a failover, intruders), until the test creates the file returned, having seen
    it (`go_file`); then the job runs out its steps at full speed."""
    go = go_file(hosts)
    return ("--step-sleep", "0.05", "--sleep-until", str(go)), [go.parent], go


def _static(hosts, k: int) -> list[str]:
    return ["--nnodes", "2", "--node-rank", str(k), "--master-addr", hosts.name(0),
            "--master-port", PORT]


def _c10d(hosts, k: int) -> list[str]:
    return ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.name(0)}:{PORT}"]


@pytest.mark.parametrize("form", [_static, _c10d], ids=["static", "c10d"])
def test_torchruns_two_node_command_lines_run_under_both_launchers(isolated_hosts, form):
    """The same command line on each host, no secret, nothing shared: an unmodified torchrun
    script (env:// init, an all-reduce) under torchrun, then under ours; then the example
    GPT, which recovers in place, under ours."""
    hosts = isolated_hosts
    plain = [str(SCRIPTS / "plain_torchrun.py"), "."]  # writes ./rank<R>.json on its host
    for launcher in ("torchrun", "unbroken"):
        procs = []
        for k in (0, 1):  # in the c10d form ranks go by join order: either host may be 1
            flags = [*form(hosts, k), "--nproc-per-node", "1"]
            argv = ([*TORCHRUN, *flags, *plain] if launcher == "torchrun" else
                    unbroken_cmd("run", *flags, "--rdzv-timeout", "60", *plain))
            procs.append(hosts.agent(k, argv))
        results = [finish(p, hosts.node_dir(k), timeout=120) for k, p in enumerate(procs)]
        both = "\n".join(r.output for r in results)
        assert [r.code for r in results] == [0, 0], f"{launcher}:\n{both}"
        ranks = {}
        for k in (0, 1):
            for path in hosts.node_dir(k).glob("rank*.json"):
                ranks[path.name] = json.loads(path.read_text())
                path.unlink()
        assert sorted(ranks) == ["rank0.json", "rank1.json"], f"{launcher}: {sorted(ranks)}"
        assert {r["sum"] for r in ranks.values()} == {3.0}
        assert {r["WORLD_SIZE"] for r in ranks.values()} == {"2"}
        if launcher == "unbroken":
            assert all(r.output.count(UNSIGNED) == 1 for r in results), both
    # The example GPT under ours: each node's run dir under its own working directory, and
    # the report reads them together.
    procs = [hosts.agent(k, unbroken_cmd("run", *form(hosts, k), "--nproc-per-node", "1",
                                         "--rdzv-id", "gpt", "--rdzv-timeout", "60",
                                         *_train(20)))
             for k in (0, 1)]
    results = [finish(p, hosts.node_dir(k), timeout=180) for k, p in enumerate(procs)]
    assert [r.code for r in results] == [0, 0], "\n".join(r.output for r in results)
    dirs = [hosts.node_dir(k) / "unbroken_runs" / "gpt" for k in (0, 1)]
    assert all((d / "control.json").exists() for d in dirs)
    summary = summarize(dirs)
    assert summary["steps"] == 20 and summary["exit_code"] == 0, summary


def test_a_node_with_another_secret_leaves_alone_and_the_job_finishes(isolated_hosts):
    hosts = isolated_hosts
    job, other = {"UNBROKEN_SECRET": "ab" * 32}, {"UNBROKEN_SECRET": "cd" * 32}
    slow, pace, go = _paced(hosts)  # until the intruders have met the job
    a0 = _unbroken(hosts, 0, *_static(hosts, 0), steps=500, env=job, script_args=slow, shared=pace)
    a1 = _unbroken(hosts, 1, *_static(hosts, 1), steps=500, env=job, script_args=slow, shared=pace)
    wait_for(lambda: _events(hosts, 0, "step"), 120, "training to start")
    # Both at once, from host 2: another secret; none while the job signs.
    t0 = time.monotonic()
    procs = [_unbroken(hosts, 2, *_static(hosts, 1), steps=500, env=secret, run_dir=f"run{i}")
             for i, secret in enumerate((other, {"UNBROKEN_SECRET": ""}))]
    intruders = [(_done(hosts, 2, proc, timeout=60, run_dir=f"run{i}"), time.monotonic() - t0)
                 for i, proc in enumerate(procs)]
    assert all(p.poll() is None for p in (a0, a1)), "the job ended before the intruders met it"
    go.touch()
    r0, r1 = _done(hosts, 0, a0), _done(hosts, 1, a1)
    assert (r0.code, r1.code) == (0, 0), r0.output + r1.output
    for (r, took), said in zip(intruders, ("secret differs from the job's", "has no secret"),
                               strict=True):
        assert r.code == 2, r.output
        errors = [line for line in r.output.splitlines() if "error" in line]
        assert len(errors) == 1 and said in errors[0], r.output
        assert "Traceback" not in r.output
        assert took < 60  # within seconds of contact; loose on 2 cores
    rejected = [e for e in r0.events("agent_rejected") if "rejected_node" in e]
    assert len(rejected) == 2, r0.events("agent_rejected")
    assert not r0.events("fault") and not r0.events("forged_message")
    assert UNSIGNED not in r0.output + r1.output


def test_a_master_name_that_resolves_late_is_waited_for(isolated_hosts):
    hosts = isolated_hosts
    name = "trainer-0"  # a pod's DNS name, published after the pod started
    hosts.add_name(0, name, hosts.addr(0))
    flags = lambda k: ("--nnodes", "2", "--node-rank", str(k), "--master-addr", name,  # noqa: E731
                       "--master-port", PORT)
    a0, a1 = _unbroken(hosts, 0, *flags(0)), _unbroken(hosts, 1, *flags(1))
    said = hosts.node_dir(1) / "agent.out"
    # Published only once node 1's agent has said it waits for it (a fixed delay raced the
    # agent's own start on a loaded machine), and then some more.
    wait_for(lambda: f"waiting for {name} to resolve" in said.read_text(errors="replace"), 120,
             f"node 1 to wait for {name}")
    time.sleep(2.0)
    hosts.add_name(1, name, hosts.addr(0))
    r1, r0 = _done(hosts, 1, a1), _done(hosts, 0, a0)
    assert (r0.code, r1.code) == (0, 0), r0.output + r1.output
    waiting = [line for line in r1.output.splitlines() if f"waiting for {name} to resolve" in line]
    assert len(waiting) == 1, r1.output  # one progress line, not one per try
    assert f"{name} resolved" in r1.output


def test_sigterm_to_a_training_nodes_agent_hands_its_ranks_to_a_standby_node(isolated_hosts):
    hosts = isolated_hosts
    flags = lambda k: ("--nnodes", "2", "--node-rank", str(k), "--master-addr",  # noqa: E731
                       hosts.name(0), "--master-port", PORT, "--shutdown-timeout", "30")
    a0 = _unbroken(hosts, 0, *flags(0), steps=300)
    a1 = _unbroken(hosts, 1, *flags(1), steps=300)
    standby = _unbroken(hosts, 2, *flags(2), "--standby", steps=300)
    wait_for(lambda: offered(_events(hosts, 2, "spares_offered")), 120,
             "the standby's spare offered")
    wait_for(lambda: any(e["step"] >= 10 for e in _events(hosts, 0, "step")), 120, "step 10")
    worker = _events(hosts, 1, "workers_started")[0]["pids"]["1"]
    a1.send_signal(signal.SIGTERM)  # as a pod deletion or a spot reclaim does
    r1 = _done(hosts, 1, a1, timeout=60)
    r0, r2 = _done(hosts, 0, a0), _done(hosts, 2, standby)
    assert r1.code == 143, r1.output
    assert (r0.code, r2.code) == (0, 0), r0.output + r2.output
    assert "ranks moved to spares" in r1.output
    assert [e["request"] for e in r0.events("drain_started")] == [{"node": 1}]
    assert not r0.events("restart") and not r0.events("fault")  # in place, no fault
    promoted = [e["slot"] for e in _events(hosts, 2, "spare_promoted") if e["source"] == "worker"]
    assert promoted == [1]
    drained = [e for e in r1.events("drained") if e.get("pid") == worker]
    assert drained, r1.events()
    last = max(e["step"] for e in r0.events("step"))
    assert last == 299


def test_drain_from_another_host_after_a_leader_failover_on_etcd(isolated_hosts):
    hosts = isolated_hosts
    etcd = ("--rdzv-backend", "etcd", "--rdzv-endpoint", hosts.etcd.endpoint, "--rdzv-id", "job")
    # No --local-addr: each agent serves, when it leads, on its address toward etcd.
    flags = lambda i, *more: (*etcd, "--nnodes", "2", "--node-rank", str(i),  # noqa: E731
                              "--max-restarts", "3", *more)
    slow, pace, go = _paced(hosts)  # until the spares have warmed up, a failover and a drain
    a0 = _unbroken(hosts, 0, *flags(0), steps=600, script_args=slow, shared=pace)
    a1 = _unbroken(hosts, 1, *flags(1, "--spares", "1"), steps=600, script_args=slow, shared=pace)
    standby = _unbroken(hosts, 2, *flags(2, "--standby"), steps=600, script_args=slow,
                        shared=pace)
    wait_for(lambda: all(offered(_events(hosts, k, "spares_offered")) for k in (1, 2)), 120,
             "both spares offered")
    wait_for(lambda: any(e["step"] >= 10 for e in _events(hosts, 0, "step")), 120, "step 10")
    a0.send_signal(signal.SIGKILL)  # the leader's agent dies, as its host would
    a0.wait()
    # Node 1 or the standby node takes over: whichever looks first once the leader is silent.
    heir = wait_for(lambda: next((k for k in (1, 2) if _events(hosts, k, "leader_elected")),
                                 None), 60, "node 1 or the standby node to take over")
    wait_for(lambda: len(_events(hosts, heir, "gen_up")) >= 1, 60, "node 0's rank recovered")
    # From host 0, whose agent is gone: the etcd endpoints reach the job after the failover.
    # Rank 0 now runs on a spare (node 1's or the standby's); the drain moves it to the other.
    drain = hosts.run(0, unbroken_cmd("drain", *etcd, "--rank", "0", "--timeout", "60"), 90)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    assert "moved rank 0" in drain.stdout
    go.touch()
    r1, r2 = _done(hosts, 1, a1), _done(hosts, 2, standby)
    # The standby node's spare took rank 0 (standby nodes' spares first), and the drain moved
    # it to node 1's: its only rank drained away, the standby node left (exit 5: drained,
    # not the end), unless it leads the job.
    assert (r1.code, r2.code) == (0, 0 if heir == 2 else 5), r1.output + r2.output
    assert [e["request"] for e in (r1, r2)[heir - 1].events("drain_started")] == [{"slot": 0}]
    steps = [e["step"] for k in (1, 2) for e in _events(hosts, k, "step") if e.get("rank") == 0]
    assert max(steps) == 599


def test_node_0_drained_on_etcd_moves_the_lead_first_and_its_agent_leaves(isolated_hosts):
    """`unbroken drain --node 0` from node 1's host, node 0 leading on etcd: node 0's agent
    hands the lead to node 1 (a compare-and-set of the claim: no --leader-timeout waited
    out, no node lost) and follows on with its worker training; node 1, now leading, moves
    rank 0 onto its spare in place; node 0's agent leaves as drained (exit 5), and the
    training goes on to the end."""
    hosts = isolated_hosts
    etcd = ("--rdzv-backend", "etcd", "--rdzv-endpoint", hosts.etcd.endpoint, "--rdzv-id", "job")
    # A failover would wait out 60 s of silence: the drain's 60 s could not cover it.
    flags = lambda i, *more: (*etcd, "--nnodes", "2", "--node-rank", str(i),  # noqa: E731
                              "--max-restarts", "0", "--leader-timeout", "60", *more)
    slow, pace, go = _paced(hosts)  # until the drain is done
    a0 = _unbroken(hosts, 0, *flags(0), steps=400, script_args=slow, shared=pace)
    a1 = _unbroken(hosts, 1, *flags(1, "--spares", "1"), steps=400, script_args=slow,
                   shared=pace)
    wait_for(lambda: offered(_events(hosts, 1, "spares_offered")), 120, "node 1's spare offered")
    wait_for(lambda: any(e["step"] >= 5 for e in _events(hosts, 0, "step")), 120, "step 5")
    drain = hosts.run(1, unbroken_cmd("drain", *etcd, "--node", "0", "--timeout", "60"), 90)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    assert "moved rank 0" in drain.stdout
    r0 = _done(hosts, 0, a0, timeout=60)
    assert r0.code == 5, r0.output  # drained: its ranks went on elsewhere, not the job done
    go.touch()
    r1 = _done(hosts, 1, a1)
    assert r1.code == 0, r1.output
    assert [(e["to"], e["term"]) for e in r0.events("lead_handed_over")] == [(1, 1)]
    assert [(e["previous"], e.get("handed")) for e in r1.events("leader_elected")] == [(0, True)]
    assert [e["request"] for e in r1.events("drain_started")] == [{"node": 0}]
    assert [e["node"] for e in r0.events("node_drained")] == [0]  # its agent's own word
    for r in (r0, r1):
        assert not r.events("node_lost") and not r.events("fault") and not r.events("restart")
    assert max(e["step"] for e in r1.events("step")) == 399


def test_drain_by_run_dir_on_a_followers_host_and_a_node_local_checkpoint_dir(isolated_hosts):
    """Two nodes, node 1 with a spare, given the same relative checkpoint_dir `ckpt`: the
    same string names a different disk on each host.
    - Every agent writes its control file: `unbroken drain RUN_DIR` on a follower's host
      (node 0's disk is not there) finds the job, and moves rank 1 onto a spare.
    - The checkpoint_dir is named at the first save as not shared, in one line, once per job;
      nothing is committed on either disk, and training goes on to the end."""
    hosts = isolated_hosts
    # Long enough for the spare to warm up; checkpoints every 5 steps to each host's own disk.
    slow, pace, go = _paced(hosts)  # until the drain is done
    args = (*slow, "--checkpoint-dir", "ckpt", "--checkpoint-every", "5")
    a0 = _unbroken(hosts, 0, *_static(hosts, 0), steps=600, script_args=args, shared=pace)
    # The spare on node 1 only: rank 1 stays on host 1, away from rank 0's disk.
    a1 = _unbroken(hosts, 1, *_static(hosts, 1), "--spares", "1", steps=600, script_args=args,
                   shared=pace)
    wait_for(lambda: offered(_events(hosts, 1, "spares_offered")), 120, "node 1's spare offered")
    wait_for(lambda: any(e["step"] >= 5 for e in _events(hosts, 0, "step")), 120, "step 5")
    run_dir = Path(hosts.node_dir(1)) / "run"
    drain = hosts.run(1, unbroken_cmd("drain", str(run_dir), "--rank", "1", "--timeout", "60"), 90)
    assert drain.returncode == 0, drain.stdout + drain.stderr
    go.touch()
    r0, r1 = _done(hosts, 0, a0), _done(hosts, 1, a1)
    assert (r0.code, r1.code) == (0, 0), r0.output + r1.output  # training goes on
    assert [e["request"] for e in r0.events("drain_started")] == [{"slot": 1}]
    said = [line for line in r0.output.splitlines() if "is not shared" in line]
    assert len(said) == 1, r0.output  # one line, once per job, not once per save
    assert "storage every node can see" in said[0]
    for k in (0, 1):
        committed = [p for p in (hosts.node_dir(k) / "ckpt").glob("*")
                     if not p.name.startswith(".")]
        assert committed == [], committed
    assert not r0.events("checkpoint_saved")
    assert max(e["step"] for e in r0.events("step")) == 599


def test_sigterm_to_a_standby_node_that_holds_no_rank_restarts_nothing(isolated_hosts):
    """A deleted standby pod takes only its spares away: no fault, no restart."""
    hosts = isolated_hosts
    flags = lambda k: ("--nnodes", "2", "--node-rank", str(k), "--master-addr",  # noqa: E731
                       hosts.name(0), "--master-port", PORT, "--max-restarts", "2")
    slow, pace, go = _paced(hosts)  # until the standby has left
    a0 = _unbroken(hosts, 0, *flags(0), steps=300, script_args=slow, shared=pace)
    a1 = _unbroken(hosts, 1, *flags(1), steps=300, script_args=slow, shared=pace)
    standby = _unbroken(hosts, 2, *flags(2), "--standby", steps=300, script_args=slow,
                        shared=pace)
    wait_for(lambda: _events(hosts, 2, "spare_ready"), 120, "the standby's spare")
    standby.send_signal(signal.SIGTERM)
    r2 = _done(hosts, 2, standby, timeout=60)
    go.touch()
    r0, r1 = _done(hosts, 0, a0), _done(hosts, 1, a1)
    assert r2.code == 143, r2.output
    assert "standby node holding no rank" in r2.output
    assert (r0.code, r1.code) == (0, 0), r0.output + r1.output
    assert not r0.events("restart") and not r0.events("fault"), r0.events("fault")
    assert max(e["step"] for e in r0.events("step")) == 299
