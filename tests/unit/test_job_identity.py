"""The pure parts of a job's identity in pods: standby ids, the dead-job window, reading a
leader claim whatever its envelope (launch/dead_job.py; shown end to end in
tests/integration/test_job_identity.py and test_pods.py)."""

from __future__ import annotations

from unbroken.control.codec import encode
from unbroken.control.messages import LeaderClaim
from unbroken.control.schema import standby_id
from unbroken.control.signing import Signer
from unbroken.launch import dead_job


def test_standby_ids_never_meet_a_node_rank_of_the_job():
    assert [standby_id(2, k) for k in (1, 2, 3)] == [100, 101, 102]
    assert standby_id(99, 1) == 100
    assert standby_id(100, 1) == 1000 and standby_id(2048, 1) == 10000
    for nnodes in (1, 7, 99, 100, 999, 1000, 2048):
        assert standby_id(nnodes, 1) >= nnodes


def test_a_job_is_watched_long_enough_for_any_live_leader_to_show_itself():
    assert dead_job.window(2.0) == 8.0  # 3 x 2 s + 2 s: a takeover and a lease period
    assert dead_job.window(0.5) == 5.0  # never under 5 s: a live leader's lease moves every 2 s at most


def test_the_leader_claim_is_read_signed_or_not_and_anything_else_is_none():
    claim = LeaderClaim(node=3, instance="abc", term=2)
    text = encode(claim)
    assert dead_job._claim(text) == claim
    assert dead_job._claim(Signer(b"k" * 32).seal("leader", text)) == claim
    assert dead_job._claim("reset:xyz") is None and dead_job._claim("{}") is None
    assert dead_job.is_reset("reset:xyz") and not dead_job.is_reset(text)
    assert not dead_job.is_reset(None)
