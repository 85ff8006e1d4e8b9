"""The job's node set and leadership's pure parts: no processes."""

from __future__ import annotations

from unbroken.control.codec import decode, encode
from unbroken.control.messages import LeaderRecord, NodeOut, NodeSet
from unbroken.launch.planning import node_set
from unbroken.launch.planning.budget import RestartBudget
from unbroken.launch.planning.node_set import QuarantineRule
from unbroken.launch.planning.planner_state import Recovery, Refill, Spares, initial_state, rebase

RULE = QuarantineRule(after=2, window=60.0)


def test_a_standby_that_took_a_lost_nodes_ranks_takes_its_place_in_the_order():
    ns = node_set.mark_out(node_set.initial(3), 1, NodeOut.LOST)
    layout = {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    after, heirs = node_set.after_attempt(ns, layout, {0: {0, 1}, 2: {4, 5}, 3: {2, 3}})
    assert after.order == [0, 3, 2] and heirs == {1: 3}  # standby 3 in node 1's place
    again, heirs = node_set.after_attempt(after, {0: [0, 1], 3: [2, 3], 2: [4, 5]},
                                          {0: {0, 1}, 3: {2, 3}, 2: {4, 5}})
    assert again.order == [0, 3, 2] and heirs == {}  # and keeps them across restarts


def test_an_out_node_nobody_took_over_leaves_the_order():
    ns = node_set.mark_out(node_set.initial(3), 2, NodeOut.DRAINED)
    after, heirs = node_set.after_attempt(ns, {0: [0], 1: [1], 2: [2]}, {0: {0}, 1: {1}})
    assert after.order == [0, 1] and heirs == {}


def test_a_node_with_repeated_faults_in_the_window_is_quarantined_once():
    ns = node_set.initial(2)
    ns, q = node_set.strike(ns, 1, 100.0, RULE)
    assert not q
    ns, q = node_set.strike(ns, 1, 200.0, RULE)  # the first fell out of the window
    assert not q
    ns, q = node_set.strike(ns, 1, 250.0, RULE)
    assert q and ns.out[1] == NodeOut.QUARANTINED
    ns, q = node_set.strike(ns, 1, 251.0, RULE)
    assert not q  # already quarantined: said once
    assert not node_set.strike(node_set.initial(2), 1, 0.0, QuarantineRule(after=0))[1]


def test_a_quarantined_node_is_never_admitted_again_but_a_lost_one_is():
    ns = node_set.mark_out(node_set.initial(3), 2, NodeOut.LOST)
    ns, _ = node_set.after_attempt(ns, {}, {})
    ns, ok = node_set.admit(ns, 2)
    assert ok and ns.order == [0, 1, 2] and 2 not in ns.out
    ns, _ = node_set.strike(ns, 1, 0.0, QuarantineRule(after=1))
    ns = node_set.mark_out(ns, 1, NodeOut.LOST)  # never downgraded
    ns, _ = node_set.after_attempt(ns, {}, {})
    ns, ok = node_set.admit(ns, 1)
    assert not ok and ns.order == [0, 2] and ns.out[1] == NodeOut.QUARANTINED


def test_the_leader_record_round_trips_through_the_codec():
    record = LeaderRecord(attempt=3, restarts_spent=2,
                          nodes=NodeSet(order=[0, 3], out={1: NodeOut.LOST},
                                        faults={1: [1.5, 2.5]}))
    assert decode(LeaderRecord, encode(record)) == record


def test_rebase_moves_every_deadline_and_nothing_else():
    s = initial_state(0, 4, {0: [0, 1], 1: [2, 3]}, RestartBudget(3))
    s.planned_at = 10.0
    s.spares = Spares(awaited={2: 11.0}, refills=[Refill(slot=3, node=1, broke_gen=0, since=12.0)])
    s.recovery = Recovery(started=13.0)
    moved = rebase(s, 1000.0)
    assert (moved.planned_at, moved.spares.awaited, moved.spares.refills[0].since,
            moved.recovery.started) \
        == (1010.0, {2: 1011.0}, 1012.0, 1013.0)
    assert s.planned_at == 10.0  # pure
    assert encode(rebase(moved, -1000.0)) == encode(s)


# ---------------------------------------------------------------- elastic gathering
ELASTIC = node_set.Gathering(least=2, cap=3, last_call=30.0)


def test_an_elastic_first_attempt_waits_for_min_then_the_last_call_then_starts_with_all():
    ns = node_set.initial(0)
    assert node_set.gather(ns, [0], 0, ELASTIC, 0, None) == (None, False)  # below MIN
    assert node_set.gather(ns, [0, 1], 0, ELASTIC, 0, None) == (None, True)  # last call opens
    assert node_set.gather(ns, [0, 1], 0, ELASTIC, 0, 10.0) == (None, True)  # ... still open
    after, _ = node_set.gather(ns, [0, 1, 2], 0, ELASTIC, 0, 10.0)  # MAX reached: no wait
    assert after.order == [0, 1, 2]
    after, _ = node_set.gather(ns, [0, 2], 0, ELASTIC, 0, 30.0)  # the last call is over
    assert after.order == [0, 2]


def test_nodes_beyond_the_cap_are_left_to_stand_by_and_the_leader_always_trains():
    after, _ = node_set.gather(node_set.initial(0), [4, 1, 0, 3, 2], 2, ELASTIC, 0, None)
    assert after.order == [2, 0, 1]
    standby = node_set.Gathering(least=2, cap=2, last_call=30.0)  # --extra-nodes standby
    after, _ = node_set.gather(node_set.initial(0), [0, 1, 2], 0, standby, 0, None)
    assert after.order == [0, 1]


def test_a_restart_waits_for_the_nodes_still_in_and_admits_newcomers_without_a_last_call():
    ns = node_set.mark_out(NodeSet(order=[0, 1, 2]), 1, NodeOut.LOST)
    assert node_set.gather(ns, [0, 3], 0, ELASTIC, 1, None) == (None, False)  # node 2 is due
    after, _ = node_set.gather(ns, [0, 2, 3], 0, ELASTIC, 1, None)
    assert after.order == [0, 2, 3] and after.out == {1: NodeOut.LOST}
    after, _ = node_set.gather(ns, [0, 2], 0, ELASTIC, 1, None)  # MIN is met: go on smaller
    assert after.order == [0, 2]


def test_a_quarantined_node_is_never_gathered_and_below_min_the_restart_waits():
    ns = NodeSet(order=[0, 1], out={1: NodeOut.QUARANTINED})
    assert node_set.gather(ns, [0, 1], 0, ELASTIC, 1, None) == (None, False)
    after, _ = node_set.gather(ns, [0, 1, 5], 0, ELASTIC, 1, None)
    assert after.order == [0, 5]


def test_a_restart_waits_the_last_call_for_the_nodes_that_stood_by_in_the_last_attempt():
    ns, rule = NodeSet(order=[0]), node_set.Gathering(least=1, cap=3, last_call=30.0)
    assert node_set.gather(ns, [0], 0, rule, 1, None, expected=(1,)) == (None, True)
    after, _ = node_set.gather(ns, [0, 1], 0, rule, 1, 0.1, expected=(1,))
    assert after.order == [0, 1]
    after, _ = node_set.gather(ns, [0], 0, rule, 1, 30.0, expected=(1,))  # it never came
    assert after.order == [0]
    after, _ = node_set.gather(ns, [0], 0, rule, 1, None)  # nobody stood by: no wait
    assert after.order == [0]


def test_nobody_is_left_when_every_node_of_the_order_is_out():
    ns = node_set.initial(2)
    assert not node_set.nobody_left(ns)
    ns = node_set.mark_out(ns, 1, NodeOut.LOST)
    assert not node_set.nobody_left(ns)  # node 0 still trains
    ns, quarantined = node_set.strike(ns, 0, 0.0, QuarantineRule(after=1, window=60.0))
    assert quarantined and node_set.nobody_left(ns)
