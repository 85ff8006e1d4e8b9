"""Which followers watch the leader's lease at every look (`election.lease_watchers`), and
what the others' watch leaves out (`schema.follower_watch`)."""

from __future__ import annotations

from unbroken.control.messages import LeaderClaim
from unbroken.control.schema import agent_lease, follower_watch
from unbroken.launch.election import lease_watchers


def test_in_a_small_job_every_follower_watches_the_leader() -> None:
    assert lease_watchers(0, [0, 1, 2], watchers=4) == {1, 2}
    assert lease_watchers(2, [0, 1, 2, 3, 4], watchers=4) == {0, 1, 3, 4}


def test_at_2048_nodes_a_few_watch_spread_away_from_the_leader() -> None:
    for leader in (0, 1000, 2047):
        chosen = lease_watchers(leader, range(2048), watchers=4)
        assert len(chosen) == 4 and leader not in chosen
        ring = sorted((k - leader) % 2048 for k in chosen)
        assert ring[0] > 200 and ring[-1] < 2048 - 200  # not the leader's neighbours (its rack)
        assert min(b - a for a, b in zip(ring, ring[1:], strict=False)) > 400  # nor each other's


def test_the_watchers_follow_the_leader_and_the_attempts_nodes() -> None:
    before = lease_watchers(0, range(64), watchers=3)
    after = lease_watchers(17, range(64), watchers=3)  # a failover: the new leader's
    assert before != after and 17 not in after
    nodes = [0, 5, 9, 12, 40, 41, 42, 63]  # an elastic job's ranks, with gaps
    assert lease_watchers(9, nodes, watchers=2) <= set(nodes) - {9}
    assert len(lease_watchers(9, nodes, watchers=2)) == 2


def test_a_follower_that_is_not_a_watcher_leaves_the_leaders_lease_out_of_its_watch() -> None:
    claim = LeaderClaim(node=0, instance="abc", term=1)
    lease = agent_lease(0, "abc").key
    assert lease in {w.key for w in follower_watch(3, 7, claim)}
    assert lease not in {w.key for w in follower_watch(3, 7, claim, lease=False)}
