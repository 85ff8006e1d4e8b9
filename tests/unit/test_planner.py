"""The leader's planner as a pure function: scenarios in, commands out. No processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from unbroken.control.codec import decode, encode
from unbroken.control.messages import (
    Departure,
    DrainKind,
    DrainRequest,
    Fault,
    FaultKind,
    Joiner,
    LeaveReason,
    NodeOut,
    OrderKind,
    StandbyJoin,
    SwitchTarget,
)
from unbroken.errors import ErrorClass
from unbroken.launch.planning.budget import RestartBudget
from unbroken.launch.planning.node_life import Strike
from unbroken.launch.planning.planner import decide
from unbroken.launch.planning.planner_commands import (
    AnswerDrain,
    EndAction,
    EndAttempt,
    MarkDrained,
    MarkFinished,
    MarkOut,
    Order,
    Record,
    WritePlan,
    WriteTarget,
)
from unbroken.launch.planning.planner_state import (
    Inbox,
    Phase,
    PlannerConfig,
    PlannerState,
    Policy,
    initial_state,
)

SHRINK = PlannerConfig(policy=Policy.SHRINK)
LOST = SHRINK.node_timeout + 1  # a lease silent this long: the node is lost
WAIT = PlannerConfig(policy=Policy.WAIT)


def fresh(world=4, budget=3, nodes=(0, 1)) -> PlannerState:
    return initial_state(0, world, list(nodes), RestartBudget(budget))


def death(slot, node=None, spare=None, wid=None, attempt=0, kind=FaultKind.CRASH) -> Fault:
    return Fault(kind=kind, rank=slot, slot=slot, wid=wid or f"{slot}.0", attempt=attempt,
                 node=node if node is not None else slot // 2, spare=spare, in_place=True)


def left(wid, gen=0, step=10, holds=True, reason=LeaveReason.PEER, error=None) -> Departure:
    return Departure(wid=wid, gen=gen, step=step, holds_state=holds, reason=reason, t=0.0,
                     error=error)


def of(commands, kind):
    return [c for c in commands if isinstance(c, kind)]


def events(commands) -> list[str]:
    return [c.event for c in of(commands, Record)]


def run(state, config=SHRINK, **inbox):
    inbox.setdefault("now", 100.0)
    return decide(state, Inbox(**inbox), config)


def all_left(state, except_dead=(), **kw):
    return {m: left(m, gen=state.gen, **kw) for m in state.members if m not in except_dead}


def test_decide_is_pure():
    s = fresh()
    before = encode(s)
    run(s, deaths=[death(1)])
    assert encode(s) == before


def test_the_state_is_a_serialisable_value():
    s, _ = run(fresh(), deaths=[death(1, spare="spare0-1")])
    assert decode(PlannerState, encode(s)) == s


def test_nothing_new_means_nothing_to_do():
    s, out = run(fresh())
    assert out == [] and s.phase == Phase.RUNNING


def test_crash_with_a_spare_ready_waits_for_the_spare_and_keeps_the_world_size():
    s, out = run(fresh(), deaths=[death(1, node=0, spare="spare0-1")])
    assert of(out, WriteTarget) == [WriteTarget(SwitchTarget(gen=1, step=-1))]  # at once
    assert s.phase == Phase.BROKEN and s.budget.spent == 1 and s.spares.promised == {1: "spare0-1"}
    # Every survivor has left, the spare has not registered yet: wait for it.
    s, out = run(s, nleft=3, departures=all_left(s, except_dead={"1.0"}), now=101)
    assert of(out, WritePlan) == []
    s, out = run(s, joiners=[Joiner("spare0-1", 1)], now=101.01)
    (plan,) = of(out, WritePlan)
    assert plan.plan.members == ["0.0", "spare0-1", "2.0", "3.0"]
    assert not of(out, Order)  # the spare's own agent promoted it; no replacement either
    s, out = run(s, nup=4, now=101.2)
    assert s.phase == Phase.RUNNING and events(out) == ["gen_up"] and s.recovered == 1


def test_crash_without_a_spare_shrinks_then_orders_a_replacement_from_its_node():
    s, out = run(fresh(), deaths=[death(3, node=1)])
    s, out = run(s, nleft=3, departures=all_left(s, except_dead={"3.0"}), now=100.05)
    (plan,) = of(out, WritePlan)
    assert plan.plan.members == ["0.0", "1.0", "2.0"]
    assert not of(out, Order)  # survivors switch first: a start-up beside it would slow it
    s, out = run(s, nup=3, now=100.1)
    assert of(out, Order)[0].node == 1
    assert of(out, Order)[0].order.kind == OrderKind.REPLACE and of(out, Order)[0].order.slot == 3
    # The replacement registers: grow back at a step boundary.
    s, out = run(s, joiners=[Joiner("3.1", 3)], max_step=40, now=103)
    assert of(out, WriteTarget) == [WriteTarget(SwitchTarget(gen=2, step=42))]


def test_crash_on_a_node_without_spares_takes_a_ready_spare_from_another_node():
    s, out = run(fresh(nodes=(0, 1)), deaths=[death(1, node=0)],
                 ready_spares=[(1, "spare1-1"), (2, "spare2-1")], standbys=[StandbyJoin(2, "i2")])
    (order,) = of(out, Order)
    assert order.node == 2 and order.order.kind == OrderKind.PROMOTE  # standby nodes first
    assert order.order.spare == "spare2-1" and order.order.slot == 1
    assert s.spares.promised == {1: "spare2-1"} and "spare2-1" in s.spares.assigned


def test_two_faults_in_one_step_are_one_recovery_charged_twice():
    s, out = run(fresh(), deaths=[death(1), death(2)])
    assert s.budget.spent == 2 and len(of(out, WriteTarget)) == 1
    s, out = run(s, nleft=2, departures=all_left(s, except_dead={"1.0", "2.0"}))
    assert of(out, WritePlan)[0].plan.members == ["0.0", "3.0"]
    s, out = run(s, nup=2, now=101)
    (up,) = [c for c in of(out, Record) if c.event == "gen_up"]
    assert up.fields["faults"] == ["crash", "crash"] and s.recovered == 2


def test_a_fault_during_a_recovery_replans_without_the_new_victim():
    s, _ = run(fresh(), deaths=[death(1)])
    s, out = run(s, nleft=3, departures=all_left(s, except_dead={"1.0"}))
    assert s.phase == Phase.FORMING and s.gen == 1
    # Rank 2 dies while generation 1 forms: the others leave it, a generation 2 follows.
    s, out = run(s, deaths=[death(2)], now=100.1)
    assert s.phase == Phase.BROKEN and of(out, WriteTarget)[0].target.gen == 2
    s, out = run(s, nleft=2, departures=all_left(s, except_dead={"2.0"}), now=100.2)
    assert of(out, WritePlan)[0].plan.members == ["0.0", "3.0"]
    assert [f.slot for f in s.recovery.faults] == [1, 2] and s.budget.spent == 2


def test_an_exception_is_a_fault_charged_once_and_recovered_in_place():
    s = fresh()
    deps = all_left(s)
    deps["2.0"] = left("2.0", reason=LeaveReason.EXCEPTION, error="ValueError: bad batch")
    s, out = run(s, nleft=4, departures=deps)
    assert events(out) == ["fault", "gen_plan"] and s.budget.spent == 1
    assert of(out, WritePlan)[0].plan.members == ["0.0", "1.0", "2.0", "3.0"]


def test_a_node_lost_with_enough_spares_elsewhere_moves_its_ranks_in_place():
    hosted = {1: {"2.0": 2, "3.0": 3}}
    s, out = run(fresh(), silences={1: LOST}, hosted=hosted, standbys=[StandbyJoin(2, "i2")],
                 ready_spares=[(2, "spare2-1"), (2, "spare2-2")])
    orders = of(out, Order)
    assert [(o.node, o.order.slot, o.order.spare) for o in orders] == [
        (2, 2, "spare2-1"), (2, 3, "spare2-2")]
    assert set(s.dead) == {"2.0", "3.0"} and s.phase == Phase.BROKEN and s.budget.spent == 2
    assert not of(out, EndAttempt)


def test_a_node_lost_without_spares_under_wait_ends_the_attempt_for_a_full_restart():
    s, out = run(fresh(), WAIT, silences={1: LOST}, hosted={1: {"2.0": 2, "3.0": 3}})
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.RESTART and end.fault.kind == FaultKind.NODE_LOST
    assert end.fault.node == 1


def test_a_node_lost_without_spares_under_shrink_goes_on_without_its_ranks():
    s, out = run(fresh(), silences={1: LOST}, hosted={1: {"2.0": 2, "3.0": 3}},
                 standbys=[StandbyJoin(2, "i2")], ready_spares=[(2, "spare2-1")])
    assert not of(out, EndAttempt)
    # One rank to the one spare; the other is dropped: no replacement is ordered from a
    # lost node, now or later.
    assert [(o.node, o.order.slot) for o in of(out, Order)] == [(2, 2)]
    assert set(s.dead) == {"2.0", "3.0"} and s.budget.spent == 2 and s.spares.refills == []
    s, out = run(s, nleft=2, departures=all_left(s, except_dead={"2.0", "3.0"}), now=200.0)
    assert not [o for o in of(out, Order) if o.order.kind == OrderKind.REPLACE]


def test_a_lost_node_that_ran_no_rank_changes_nothing():
    s, out = run(fresh(), silences={1: LOST}, hosted={1: {}})
    assert not of(out, EndAttempt) and s.phase == Phase.RUNNING and s.nodes.lost == [1]


def test_a_lost_node_that_never_said_what_it_ran_is_taken_to_run_what_it_started():
    s = initial_state(0, 4, {0: [0, 1], 1: [2, 3]}, RestartBudget(3))
    s, out = run(s, silences={1: LOST}, hosted={1: None}, standbys=[StandbyJoin(2, "i2")],
                 ready_spares=[(2, "spare2-1"), (2, "spare2-2")])
    assert [(o.order.slot, o.order.spare) for o in of(out, Order)] == [
        (2, "spare2-1"), (3, "spare2-2")]
    s, out = run(fresh(), silences={1: LOST}, hosted={1: None})  # no layout: what did it run?
    assert of(out, EndAttempt)[0].action == EndAction.RESTART


def test_a_promised_spare_left_out_of_a_plan_is_no_longer_waited_for():
    s, _ = run(fresh(), deaths=[death(1, node=0, spare="spare0-1")])
    s, out = run(s, nleft=3, departures=all_left(s, except_dead={"1.0"}),
                 now=100 + SHRINK.spare_wait + 1)
    assert of(out, WritePlan)[0].plan.members == ["0.0", "2.0", "3.0"]
    assert s.spares.promised == {} and 1 in s.spares.awaited  # it may still join, like a replacement


def test_a_drain_promotes_a_spare_and_switches_once_it_has_joined():
    s, out = run(fresh(), drains=[DrainRequest(DrainKind.RANK, 1)],
                 ready_spares=[(0, "spare0-1")])
    assert [(o.node, o.order.spare, o.order.slot) for o in of(out, Order)] == [(0, "spare0-1", 1)]
    assert events(out) == ["spare_assigned", "drain_started"]
    s, out = run(s, joiners=[Joiner("spare0-1", 1)], max_step=20)
    assert of(out, WriteTarget)[0].target == SwitchTarget(gen=1, step=22)
    s, out = run(s, nleft=4, departures=all_left(s, reason=LeaveReason.SWITCH))
    assert of(out, MarkDrained) == [MarkDrained("1.0")]
    assert of(out, WritePlan)[0].plan.members == ["0.0", "spare0-1", "2.0", "3.0"]
    s, out = run(s, nup=4, now=100.1)
    (answer,) = of(out, AnswerDrain)
    assert answer.index == 0 and answer.outcome.ok and answer.outcome.moves[0]["to"] == "spare0-1"
    assert s.budget.spent == 0  # a drain is no fault


def test_a_drain_without_ready_spares_is_refused_with_a_reason():
    s, out = run(fresh(), drains=[DrainRequest(DrainKind.NODE, 1)], hosted={1: {"2.0": 2}})
    (answer,) = of(out, AnswerDrain)
    assert not answer.outcome.ok and "0 ready spare(s)" in answer.outcome.error
    s, out = run(s, drains=[DrainRequest(DrainKind.NODE, 0)])
    assert "node 0 hosts the control store (the embedded TCPStore)" \
        in of(out, AnswerDrain)[0].outcome.error
    assert of(out, AnswerDrain)[0].index == 1


def test_a_drain_of_the_leaders_own_node_on_etcd_moves_the_lead_first():
    """With etcd the leader may be any node. A drain of its own node is held, and the lead
    named for the lowest other node that runs ranks; the heir's planner takes the held drain
    up as a new one (same index) and moves the ranks; the old leader's planner never does."""
    request = DrainRequest(DrainKind.NODE, 1)
    hosted = {0: {"0.0": 0, "1.0": 1}, 1: {"2.0": 2, "3.0": 3}}
    leader1 = replace(SHRINK, leader_node=1, elected=True)
    s, out = run(fresh(), leader1, drains=[request], hosted=hosted)
    assert not of(out, AnswerDrain) and not of(out, Order)  # nothing moves under this leader
    assert s.drains.lead_to == 0 and s.drains.held == {0: request}
    s, out = run(s, leader1, hosted=hosted, ready_spares=[(0, "s0"), (0, "s1")])
    assert s.drains.held == {0: request} and not of(out, Order)  # still waiting for the heir
    s = decode(PlannerState, encode(s))  # as the heir reads it (the persisted state)
    heir = replace(SHRINK, leader_node=0, elected=True)
    s, out = run(s, heir, hosted=hosted, ready_spares=[(0, "s0"), (0, "s1")])
    assert [(o.node, o.order.spare, o.order.slot) for o in of(out, Order)] == \
        [(0, "s0", 2), (0, "s1", 3)]
    assert events(out)[-1] == "drain_started" and s.drains.held == {} and s.drains.lead_to is None
    assert s.drains.draining == {"2.0": ("s0", 0), "3.0": ("s1", 0)}  # answered as drain 0


def test_a_leaders_own_node_is_not_drained_without_an_heir_nor_on_the_tcpstore():
    lone = {1: {"0.0": 0, "1.0": 1, "2.0": 2}}  # only the leader's node runs ranks
    s, out = run(fresh(), replace(SHRINK, leader_node=1, elected=True),
                 drains=[DrainRequest(DrainKind.NODE, 1)], hosted=lone)
    (answer,) = of(out, AnswerDrain)
    assert "no other node runs ranks of the job to take the lead" in answer.outcome.error
    assert s.drains.lead_to is None and s.drains.held == {}
    s, out = run(s, SHRINK, drains=[DrainRequest(DrainKind.NODE, 0)], hosted={0: {"0.0": 0}})
    assert "node 0 hosts the control store (the embedded TCPStore)" \
        in of(out, AnswerDrain)[0].outcome.error
    s, out = run(s, replace(SHRINK, leader_node=1, elected=True),
                 drains=[DrainRequest(DrainKind.NODE, 0)], hosted={0: {"0.0": 0}})
    assert "0 ready spare(s)" in of(out, AnswerDrain)[0].outcome.error  # not refused as node 0


@pytest.mark.parametrize("config", [SHRINK, WAIT])
def test_a_fault_with_the_budget_spent_gives_up_at_once(config):
    s, out = run(fresh(budget=0), config, deaths=[death(0)])
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.GIVE_UP and "restart budget of 0 is spent" in end.reason
    assert end.fault.slot == 0 and not of(out, WriteTarget)  # nobody waits for departures


def test_the_budget_is_shared_by_members_and_replacements():
    s, _ = run(fresh(budget=2), WAIT, deaths=[death(1, node=0)])
    assert s.spares.awaited and s.budget.left == 1  # under wait the replacement is ordered at once
    s, _ = run(s, WAIT, deaths=[death(1, node=0, wid="1.1")])  # the replacement crashed
    assert s.budget.left == 0 and s.spares.awaited  # paid for: ordered again
    s, out = run(s, WAIT, deaths=[death(1, node=0, wid="1.2")])
    assert of(out, EndAttempt)[0].action == EndAction.GIVE_UP


def test_under_wait_a_slot_nothing_can_refill_restarts_without_waiting():
    # A standby node's rank dies: standby nodes start no fresh workers and no spare is ready.
    s, _ = run(fresh(), WAIT, standbys=[StandbyJoin(2, "i2")])
    s, out = run(s, WAIT, deaths=[death(1, node=2)])
    s, out = run(s, WAIT, nleft=3, departures=all_left(s, except_dead={"1.0"}), now=100.1)
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.RESTART and "rank(s) [1] cannot be refilled" in end.reason


def test_under_wait_a_slow_replacement_is_waited_for_then_the_job_shrinks():
    s, _ = run(fresh(), WAIT, deaths=[death(1, node=0)])
    s, out = run(s, WAIT, nleft=3, departures=all_left(s, except_dead={"1.0"}), now=101)
    assert not of(out, WritePlan)
    s, out = run(s, WAIT, now=100 + WAIT.join_timeout + 1)
    assert of(out, WritePlan)[0].plan.members == ["0.0", "2.0", "3.0"]


def test_a_hang_reported_by_one_node_is_one_death_charged_once():
    hang = death(2, node=1, kind=FaultKind.HANG)
    s, out = run(fresh(), deaths=[hang])
    s, out = run(s, deaths=[hang])  # the same death read again (a re-delivered message)
    assert s.budget.spent == 1 and list(s.dead) == ["2.0"]


def test_a_stale_death_from_an_older_attempt_is_ignored():
    s = initial_state(1, 4, [0, 1], RestartBudget(3))
    s, out = run(s, deaths=[death(1, attempt=0)])
    assert out == [] and s.phase == Phase.RUNNING and s.budget.spent == 0


def test_a_stale_departure_from_an_older_generation_does_not_count():
    s, _ = run(fresh(), deaths=[death(1)])
    s, _ = run(s, nleft=3, departures=all_left(s, except_dead={"1.0"}))
    assert s.gen == 1
    s, out = run(s, nleft=1, departures={"0.0": left("0.0", gen=0)}, now=100.1)
    assert "0.0" not in s.departed


def test_a_replacement_that_registers_while_a_generation_forms_is_placed_once_it_is_up():
    """Regression: a joiner seen in the look that found the generation up was never placed."""
    s, _ = run(fresh(world=2), deaths=[death(1, node=0)])
    s, _ = run(s, nleft=1, departures=all_left(s, except_dead={"1.0"}))
    s, out = run(s, joiners=[Joiner("1.1", 1)], nup=1, max_step=12, now=100.5)
    assert events(out)[0] == "gen_up"
    assert of(out, WriteTarget) == [WriteTarget(SwitchTarget(gen=2, step=14))]


def test_a_recovery_that_does_not_form_in_time_falls_back_to_a_restart():
    s, _ = run(fresh(), deaths=[death(1)])
    s, _ = run(s, nleft=3, departures=all_left(s, except_dead={"1.0"}))
    s, out = run(s, now=100 + SHRINK.recovery_timeout + 1)
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.FALLBACK and "did not form" in end.reason


def test_a_fallback_with_no_fault_paid_for_is_a_restart_the_leader_charges():
    s = fresh()
    s, out = run(s, nleft=4, departures=all_left(s), now=100)  # every member left on errors
    s, out = run(s, now=100 + SHRINK.recovery_timeout + 1)
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.RESTART and end.fault.kind == FaultKind.RECOVERY_FAILED


def test_no_holder_of_the_state_falls_back_to_a_restart():
    s, _ = run(fresh(world=2), deaths=[death(0)])
    s, out = run(s, nleft=1, departures={"1.0": left("1.0", holds=False)})
    assert of(out, EndAttempt)[0].action == EndAction.FALLBACK


def test_finished_only_when_every_member_of_the_final_generation_is_done():
    s, out = run(fresh(), ndone=3)
    assert not of(out, MarkFinished) and not s.finished
    s, out = run(s, ndone=4)
    assert of(out, MarkFinished) and s.finished


def test_a_quarantined_node_gets_no_replacement_and_gives_no_spare():
    s, _ = run(fresh(), deaths=[death(2, node=1)])  # a death is a strike against its node
    assert [r.slot for r in s.spares.refills] == [2]  # a replacement from node 1, in a moment
    s, out = run(s, strikes=[Strike(1, 1.0), Strike(1, 2.0)], ready_spares=[(1, "spare1-1")])
    assert s.spares.refills == [] and s.nodes.quarantined == [1]
    assert MarkOut(1, NodeOut.QUARANTINED) in out and events(out) == ["node_quarantined"]
    s, out = run(s, deaths=[death(3, node=0)], ready_spares=[(1, "spare1-1")], now=200.0)
    assert not [o for o in of(out, Order) if o.node == 1]


# ---------------------------------------------------------------- node lifecycle news
def test_a_lease_silence_past_the_node_timeout_loses_the_node_once():
    s, out = run(fresh(), silences={0: 0.5, 1: SHRINK.node_timeout - 0.1})
    assert out == [] and s.nodes.lost == []  # silent, not yet past the timeout
    s, out = run(s, silences={1: LOST}, hosted={1: {}})
    assert s.nodes.lost == [1] and s.nodes.job.out == {1: NodeOut.LOST}
    (lost,) = [c for c in of(out, Record) if c.event == "node_lost"]
    assert lost.fields["lost_node"] == 1 and "silent for" in lost.fields["detail"]
    s, out = run(s, silences={1: LOST + 5})
    assert out == []  # said once


def test_a_silent_node_that_was_released_is_no_loss():
    s, out = run(fresh(), silences={1: LOST}, released=[1])
    assert out == [] and s.nodes.released == [1] and s.nodes.lost == []


def test_a_lost_node_ends_the_attempt_while_the_workers_do_not_recover_in_place():
    s, out = run(fresh(), silences={1: LOST}, in_place=False, deaths=[death(0)])
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.RESTART and end.fault.kind == FaultKind.NODE_LOST
    assert s.budget.spent == 0 and s.dead == {}  # the in-place queues are not taken in


def test_an_elastic_job_below_its_minimum_restarts_to_wait_for_nodes():
    s, out = run(fresh(), PlannerConfig(least=2), silences={1: LOST}, hosted={1: {}})
    assert of(out, EndAttempt)[0].action == EndAction.RESTART
    s, out = run(fresh(), PlannerConfig(least=2, standby_takes_ranks=True),
                 silences={1: LOST}, hosted={1: {}}, standbys=[StandbyJoin(2, "i2")])
    assert not of(out, EndAttempt)  # the standby node counts


def test_a_successor_declares_its_silent_predecessor_lost_and_moves_its_ranks():
    s, out = run(fresh(), predecessor=0, hosted={0: {"0.0": 0, "1.0": 1}}, standbys=[
        StandbyJoin(2, "i2")], ready_spares=[(2, "spare2-1"), (2, "spare2-2")])
    assert s.nodes.lost == [0] and "went silent" in of(out, Record)[0].fields["detail"]
    assert [(o.node, o.order.slot) for o in of(out, Order)] == [(2, 0), (2, 1)]


def test_a_standby_arrival_is_kept_and_a_forged_one_ignored():
    s, out = run(fresh(), standbys=[StandbyJoin(2, "i2"), None])
    assert out == [] and s.nodes.standby == {2: "i2"} and s.seen.standbys == 2
    s, _ = run(s, silences={2: LOST}, hosted={2: {}})
    assert s.nodes.lost == [2]  # a standby node's agent is watched like any other


def test_strikes_quarantine_a_node_once_even_without_in_place_recovery():
    s, out = run(fresh(), in_place=False, strikes=[Strike(1, t) for t in (1.0, 2.0, 3.0, 4.0)])
    assert s.nodes.quarantined == [1]
    assert [c for c in out if isinstance(c, MarkOut)] == [MarkOut(1, NodeOut.QUARANTINED)]


def test_a_worker_that_stops_the_job_ends_it_without_spending_the_budget_or_a_strike():
    """A death classified `stop` (the anomaly limit: `JobStopped`) is the job's decision,
    not a fault to recover: the attempt gives up (exit 1) with the worker's report, the
    restart budget is untouched and the node gets no strike."""
    stop = death(1)
    stop.error_class, stop.detail = ErrorClass.STOP, "JobStopped: 3 numerical anomalies"
    s, out = run(fresh(budget=3), deaths=[stop])
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.GIVE_UP and "3 numerical anomalies" in end.reason
    assert s.budget.spent == 0 and not of(out, WriteTarget)
    assert s.nodes.job.faults == {}  # no strike against its node
    crash = run(fresh(budget=3), deaths=[death(1)])[0]
    assert crash.nodes.job.faults  # ...where a crash counts one


def fixed(state, who="the Trainer", **kw):
    """Every survivor's departure, from a job whose framework fixed the world size."""
    return {m: replace(d, fixed_world=who) for m, d in all_left(state, **kw).items()}


def test_a_fixed_world_never_shrinks_under_shrink_it_waits_for_its_replacement_and_says_so():
    s, _ = run(fresh(), deaths=[death(1, node=0)])
    s, out = run(s, nleft=3, departures=fixed(s, except_dead={"1.0"}), now=100.05)
    assert not of(out, WritePlan)  # under --on-fault shrink, no shrunk generation
    (order,) = of(out, Order)  # the replacement ordered at once, not after a delay
    assert order.node == 0 and order.order.kind == OrderKind.REPLACE and order.order.slot == 1
    said = [c.text for c in out if c.__class__.__name__ == "Say"]
    assert said == [f"rank(s) [1]: waiting up to {SHRINK.join_timeout:g}s for a spare or a "
                    "replacement, since the Trainer cannot change its world size"]
    s, out = run(s, now=100.5)
    assert not of(out, WritePlan) and not [c for c in out if c.__class__.__name__ == "Say"]
    s, out = run(s, joiners=[Joiner("1.1", 1)], now=101)
    assert of(out, WritePlan)[0].plan.members == ["0.0", "1.1", "2.0", "3.0"]


def test_a_fixed_world_whose_replacement_never_comes_restarts_instead_of_shrinking():
    s, _ = run(fresh(), deaths=[death(1, node=0)])
    s, _ = run(s, nleft=3, departures=fixed(s, except_dead={"1.0"}), now=100.05)
    s, out = run(s, now=100 + SHRINK.join_timeout + 1)
    assert not of(out, WritePlan)
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.FALLBACK and "not refilled in time" in end.reason


def test_a_fault_that_recurs_before_any_step_is_committed_restarts_every_worker():
    s = fresh()
    deps = all_left(s)
    deps["2.0"] = left("2.0", reason=LeaveReason.EXCEPTION, error="RuntimeError: gather")
    s, out = run(s, nleft=4, departures=deps)
    assert of(out, WritePlan) and not of(out, EndAttempt)  # the first: in place
    s, _ = run(s, nup=4, now=100.1)
    deps = {m: replace(d, gen=s.gen) for m, d in deps.items()}  # again, still at step 10
    s, out = run(s, nleft=4, departures=deps, now=100.2)
    (end,) = of(out, EndAttempt)
    assert end.action == EndAction.RESTART and "a second fault at step 10" in end.reason
    assert s.budget.spent == 2  # both faults paid, no more


def test_a_death_before_any_step_is_committed_is_recovered_in_place_again():
    """A promoted spare killed at once: the survivors are at the same committed step, but a
    death is not a recurring fault (only an exception of the job's own code is)."""
    s = fresh()
    s, out = run(s, deaths=[death(1, node=0)])
    s, out = run(s, nleft=3, departures=all_left(s, except_dead={"1.0"}), now=100.05)
    s, _ = run(s, nup=3, now=100.1)
    s, _ = run(s, deaths=[death(2, node=0)], now=100.2)
    s, out = run(s, nleft=2, departures=all_left(s, except_dead={"1.0", "2.0"}), now=100.3)
    assert not of(out, EndAttempt), out


def test_a_fault_after_a_committed_step_is_recovered_in_place_again():
    s = fresh()
    deps = all_left(s)
    deps["2.0"] = left("2.0", reason=LeaveReason.EXCEPTION, error="RuntimeError: one")
    s, _ = run(s, nleft=4, departures=deps)
    s, _ = run(s, nup=4, now=100.1)
    deps = {m: replace(d, gen=s.gen, step=11) for m, d in deps.items()}
    s, out = run(s, nleft=4, departures=deps, now=100.2)
    assert of(out, WritePlan) and not of(out, EndAttempt)
