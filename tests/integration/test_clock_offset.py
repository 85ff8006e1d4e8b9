"""Each node's clock offset to the leader, bounded at rendezvous (`control.clock`)."""

from __future__ import annotations

from conftest import MASTER_PORT, TINY, events_in, finish_on, run_dir_on, start_on

from unbroken.telemetry.report import load_events


def test_two_nodes_each_log_their_clock_offset(isolated_hosts):
    """Two nodes on two hosts that share nothing (tests/netns.py): each agent logs its own
    offset in its own run dir, and the report reads both dirs."""
    hosts = isolated_hosts

    def node(rank):
        return start_on(hosts, rank, "--nnodes", "2", "--node-rank", str(rank),
                        "--master-addr", hosts.name(0), "--master-port", MASTER_PORT,
                        "--nproc-per-node", "1", "--rdzv-id", "job", "--rdzv-timeout", "60",
                        args=["--steps", "10", *TINY])

    leader, follower = node(0), node(1)
    r1, r0 = finish_on(hosts, 1, follower), finish_on(hosts, 0, leader)
    assert r0.code == 0, r0.output
    assert r1.code == 0, r1.output
    run_dirs = [run_dir_on(hosts, 0), run_dir_on(hosts, 1)]
    offsets = {e["node"]: e for e in events_in(run_dirs, "clock_offset")}
    assert set(offsets) == {0, 1}
    assert [e["node"] for e in r0.events("clock_offset")] == [0]  # the leader's own, exact
    assert [e["node"] for e in r1.events("clock_offset")] == [1]  # measured by node 1's agent
    assert (offsets[0]["offset"], offsets[0]["error"], offsets[0]["attempt"]) == (0.0, 0.0, 0)
    mine = offsets[1]
    assert mine["attempt"] == 0
    assert 0 <= mine["error"] < 1.0
    assert abs(mine["offset"]) <= mine["error"] + 0.05  # one machine, one clock (every host)
    merged = load_events(run_dirs)
    assert sum(e["event"] == "clock_offset" for e in merged) == 2
    assert any(e["event"] == "step" for e in merged)
