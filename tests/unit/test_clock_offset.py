"""Each node's clock offset to the leader, bounded at rendezvous (`control.clock`)."""

from __future__ import annotations

import pytest

from unbroken.control.clock import estimate_offset
from unbroken.control.codec import decode, encode
from unbroken.control.messages import AttemptPlan, NodeJoin, NodeLayout
from unbroken.telemetry.report import load_events


def test_same_clock_gives_an_offset_near_zero_within_its_error():
    # sent 100.0, seen by the leader at 100.1, plan written at 100.2, read at 100.3
    offset, error = estimate_offset(100.0, 100.1, 100.2, 100.3)
    assert offset == pytest.approx(0.0) and error == pytest.approx(0.1)
    assert abs(offset) <= error


def test_a_follower_clock_5s_behind_gives_plus_5():
    # The follower's clock reads 5 s less than the leader's; the same exchange as above.
    offset, error = estimate_offset(95.0, 100.1, 100.2, 95.3)
    assert offset == pytest.approx(5.0) and error == pytest.approx(0.1)
    ahead = estimate_offset(105.0, 100.1, 100.2, 105.3)
    assert ahead[0] == pytest.approx(-5.0)


def test_exact_bounds_give_zero_error():
    assert estimate_offset(10.0, 12.0, 12.0, 10.0) == (2.0, 0.0)


def test_crossed_bounds_give_no_estimate():
    # The plan read "before" the join was sent: the follower's clock was stepped back.
    assert estimate_offset(100.0, 100.1, 100.2, 99.0) is None


def test_the_stamps_are_wire_compatible():
    """New fields round-trip, and an old message (without them) decodes to the defaults."""
    plan = AttemptPlan(attempt=1, world_size=2, nodes={1: NodeLayout(0, 2, "i")},
                       worker_port=5, clock_seen={1: 12.5}, clock_written=13.0)
    again = decode(AttemptPlan, encode(plan))
    assert again.clock_seen == {1: 12.5} and again.clock_written == 13.0
    old = decode(AttemptPlan, '{"attempt":0,"world_size":1,"nodes":{},"worker_port":5}')
    assert old.clock_seen == {} and old.clock_written is None
    join = decode(NodeJoin, '{"nproc":1,"instance":"i","pid":1,"host":"h"}')
    assert join.sent is None
    assert decode(NodeJoin, encode(NodeJoin(1, "i", 1, "h", sent=3.5))).sent == 3.5


def test_a_dir_one_node_wrote_moves_by_that_nodes_offset_whatever_node_its_events_name(tmp_path):
    """The leader writes events about other nodes (a fault with `node: 1`) on its own clock:
    only node 1's own dir moves by node 1's offset."""
    import json

    def log(d, *events):
        d.mkdir()
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    log(tmp_path / "n0", {"t": 100.0, "event": "agent_start", "node": 0},
        {"t": 101.0, "event": "fault", "node": 1, "source": "agent"})
    log(tmp_path / "n1", {"t": 95.0, "event": "agent_start", "node": 1},
        {"t": 96.0, "event": "clock_offset", "node": 1, "offset": 5.0, "error": 0.01})
    merged = {(e["event"], e["node"]): e["t"] for e in load_events([tmp_path / "n0", tmp_path / "n1"])}
    assert merged[("fault", 1)] == 101.0  # the leader's clock already
    assert merged[("agent_start", 1)] == 100.0 and merged[("clock_offset", 1)] == 101.0
    assert merged[("agent_start", 0)] == 100.0
