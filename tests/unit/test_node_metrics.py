"""One node's counters (telemetry/node_metrics.py): what its agent and its workers recorded,
folded once; rank-seconds that never go down, charged only while the node held the slot;
how far behind the present they are counted; the leader's capacity ledger and its
resumption by a successor. Pure: events built in the test."""

from __future__ import annotations

import json

import pytest

from unbroken.telemetry import schema as ev
from unbroken.telemetry.job_ledger import CapacityLedger
from unbroken.telemetry.metric_names import Metric
from unbroken.telemetry.node_metrics import (
    IN_PLACE,
    RESTART,
    SETTLE_S,
    NodeCounters,
    RankSeconds,
    settled_until,
    tenancy_seconds,
)


def fault(t: float, slot: int, kind: str = "crash", attempt: int = 0) -> ev.Fault:
    return ev.Fault(t=t, source="agent", node=1, kind=kind, rank=slot, slot=slot,
                    attempt=attempt, detail="killed")


def started(t: float, slots: list[int], attempt: int = 0) -> ev.WorkersStarted:
    return ev.WorkersStarted(t=t, source="agent", node=1, attempt=attempt, duration=0.1,
                             pids={str(s): 100 + s for s in slots})


def test_a_fault_logged_twice_counts_once_and_ends_the_slots_stay_here():
    c = NodeCounters(node=1)
    c.fold_own(started(10.0, [2, 3]))
    assert c.fold_own(fault(20.0, 3)) == [(Metric.NODE_FAULTS, "crash", 1)]
    assert c.fold_own(fault(20.0, 3)) == []  # taken in place, then charged to a restart
    assert c.faults == {"crash": 1}
    assert c.slots == {2: (10.0, None), 3: (10.0, 20.0)}


def test_recoveries_count_generations_joined_and_attempts_restarted_once_each():
    c = NodeCounters(node=1)
    assert c.fold_own(started(1.0, [2])) == []  # the first attempt is no recovery
    obs = [o for gen in (1, 1, 2) for o in c.fold_worker(ev.GenSwitch(
        t=5.0 + gen, source="worker", node=1, slot=2, gen=gen, reason="fault", step=4,
        world_size=2, state_from=0, received_bytes=0, tries=1, rolled_back=0, duration=0.3))]
    assert [o for o in obs if o[0] == Metric.NODE_RECOVERIES] == [
        (Metric.NODE_RECOVERIES, IN_PLACE, 1), (Metric.NODE_RECOVERIES, IN_PLACE, 1)]
    assert [o[2] for o in obs if o[0] == Metric.NODE_SWITCH_TIME] == [0.3, 0.3, 0.3]
    assert c.fold_own(started(9.0, [2], attempt=1)) == [(Metric.NODE_RECOVERIES, RESTART, 1)]
    assert c.fold_own(started(9.5, [2], attempt=1)) == []


def test_steps_and_stalls_add_up_and_a_slot_promoted_here_is_held_from_its_first_event():
    c = NodeCounters(node=1)
    for t in (3.0, 4.0):
        c.fold_worker(ev.Step(t=t, source="worker", node=1, slot=5, step=int(t), duration=1.0))
    c.fold_worker(ev.CheckpointSaved(t=4.5, source="worker", node=1, slot=5, step=4, path="p",
                                     bytes=None, stall=0.25, snapshot=0.1, persist=0.2,
                                     durable=0.5, deleted=None, retention_error=None))
    assert (c.steps, c.stall) == (2, 0.25)
    assert c.slots == {5: (3.0, None)} and c.last_seen == {5: 4.5}


def test_rank_seconds_are_charged_only_while_the_node_held_the_slot():
    timeline = [{"slot": 0, "start": 0.0, "end": 10.0, "category": "productive_step"},
                {"slot": 0, "start": 10.0, "end": 14.0, "category": "infrastructure_recovery"},
                {"slot": 1, "start": 0.0, "end": 14.0, "category": "idle"}]
    seconds = tenancy_seconds(timeline, {0: (2.0, 12.0)}, until=14.0)
    assert seconds["productive_step"] == pytest.approx(8.0)
    assert seconds["infrastructure_recovery"] == pytest.approx(2.0)
    assert seconds["idle"] == 0.0  # slot 1 was never this node's


def test_rank_seconds_never_go_down_when_the_accounting_moves_a_second():
    r = RankSeconds()
    first = r.advance({"productive_step": 10.0, "wasted_progress": 0.0})
    assert first == [(Metric.NODE_RANK_SECONDS, "productive_step", 10.0)]
    moved = r.advance({"productive_step": 7.0, "wasted_progress": 3.0})  # a rollback
    assert moved == [(Metric.NODE_RANK_SECONDS, "wasted_progress", 3.0)]
    assert r.advance({"productive_step": 12.0})[0][2] == pytest.approx(2.0)


def test_time_is_counted_up_to_the_oldest_held_slots_last_event_within_the_bound():
    c = NodeCounters(node=1)
    c.slots = {0: (0.0, None), 1: (0.0, None), 2: (0.0, 50.0)}  # slot 2 left: not waited for
    c.last_seen = {0: 98.0, 1: 95.0, 2: 10.0}
    assert settled_until(100.0, c) == 95.0
    c.last_seen[1] = 1.0  # a hung rank holds the count back no more than SETTLE_S
    assert settled_until(100.0, c) == 100.0 - SETTLE_S
    assert settled_until(100.0, NodeCounters(node=1)) == 100.0  # nothing held


# ---------------------------------------------------------------- the leader's ledger

def gen_up(t: float, gen: int, world: int) -> ev.GenUp:
    return ev.GenUp(t=t, source="agent", node=0, gen=gen, world_size=world, duration=0.2,
                    faults=["node_lost"])


def test_capacity_lost_integrates_the_ranks_missing_from_the_full_world():
    ledger = CapacityLedger()
    assert ledger.total(50.0) == 0.0
    ledger.fold(ev.Rendezvous(t=10.0, source="agent", node=0, attempt=0, world_size=8,
                              duration=1.0, worker_port=1))
    ledger.fold(gen_up(20.0, 1, 6))  # a node of 2 lost, the job goes on shrunk
    assert ledger.total(30.0) == pytest.approx(2 * 10.0)
    ledger.fold(gen_up(40.0, 2, 8))  # grown back
    assert ledger.total(100.0) == pytest.approx(2 * 20.0) and ledger.gen == 2


def test_a_successor_resumes_the_ledger_and_ignores_what_it_already_holds():
    ledger = CapacityLedger()
    ledger.change(4, 0.0)
    ledger.change(3, 10.0)
    saved = json.loads(json.dumps(ledger.plain()))  # through the LeaderRecord
    successor = CapacityLedger.from_plain(saved)
    successor.fold(gen_up(5.0, 1, 3))  # the old leader's event, read again from a shared log
    assert successor.total(30.0) == pytest.approx(1 * 20.0)
    successor.fold(gen_up(30.0, 2, 4))
    assert successor.total(60.0) == pytest.approx(20.0) and successor.missing == 0
    assert CapacityLedger.from_plain(None).total(1e9) == 0.0
