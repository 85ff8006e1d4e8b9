"""The replicas' policy, as tables: majority, classes, the two-replica machine, REPORT, K."""

from __future__ import annotations

import itertools

import pytest

from unbroken.runtime.anomalies.replicas import (
    Mismatch,
    NeedVote,
    Pending,
    Replace,
    ReplicaState,
    Resolution,
    Rollback,
    Settled,
    Stage,
    Stop,
    Sums,
    Verified,
    coverage,
    decide,
    due,
    interval,
    judge,
)
from unbroken.runtime.config import SdcConfig, SdcRemedy

GOOD, BAD, WORSE, OTHER = (11, 12), (99, 98), (77, 76), (5, 6)
CONFIG = SdcConfig(enabled=True)
REPORT = SdcConfig(enabled=True, remedy=SdcRemedy.REPORT)
AT_10 = ReplicaState(last_verified=10)


def ddp(step: int, *sums: tuple[int, int], slots: tuple[int, ...] | None = None,
        **kw) -> Sums:
    n = len(sums)
    return Sums(step, tuple(sums), (0,) * n, slots or tuple(range(n)), **kw)


# ---------------------------------------------------------------- agreement and majority
def test_agreement_verifies_the_step():
    state, actions = decide(ReplicaState(), ddp(10, GOOD, GOOD, GOOD), CONFIG)
    assert actions == [Verified(10)] and state == AT_10


@pytest.mark.parametrize("n", range(3, 9))
def test_a_majority_blames_the_minority_and_nobody_else(n):
    slots = tuple(200 - 3 * r for r in range(n))  # slots are not ranks
    for k in range(1, (n - 1) // 2 + 1):
        for bad in itertools.combinations(range(n), k):
            sums = [GOOD] * n
            for j, r in enumerate(bad):
                sums[r] = (BAD[0] + j, BAD[1])  # each corrupt rank wrong its own way
            state, actions = decide(AT_10, ddp(20, *sums, slots=slots), CONFIG)
            blamed = tuple(sorted(slots[r] for r in bad))
            assert actions == [Mismatch(20, 10, blamed, (0,), Resolution.MAJORITY),
                               Rollback(10, replay=False), Replace(blamed)], (n, bad)
            assert state == AT_10


def test_half_is_not_a_majority():
    state, actions = decide(AT_10, ddp(20, GOOD, GOOD, BAD, BAD), CONFIG)
    assert actions == [Mismatch(20, 10, (), (0,), Resolution.UNRESOLVED),
                       Rollback(10, replay=True)]
    assert state.pending == Pending(20, (0, 1, 2, 3), (0,), (GOOD, GOOD, BAD, BAD))


def test_hsdp_classes_are_judged_each_on_its_own():
    # 3 replicas of 2 shards: rank r holds shard r % 2; shards differ from each other.
    classes, slots = (0, 1, 0, 1, 0, 1), tuple(range(6))
    agree = Sums(10, (GOOD, OTHER, GOOD, OTHER, GOOD, OTHER), classes, slots)
    assert decide(ReplicaState(), agree, CONFIG)[1] == [Verified(10)]
    bad = Sums(20, (GOOD, OTHER, GOOD, BAD, GOOD, OTHER), classes, slots)
    _, actions = decide(AT_10, bad, CONFIG)
    assert actions == [Mismatch(20, 10, (3,), (1,), Resolution.MAJORITY),
                       Rollback(10, replay=False), Replace((3,))]
    both = Sums(20, (BAD, OTHER, GOOD, WORSE, GOOD, OTHER), classes, slots)
    assert judge(both)[0].blamed == (0,) and judge(both)[1].blamed == (3,)
    assert decide(AT_10, both, CONFIG)[1][-1] == Replace((0, 3))


def test_a_class_of_one_is_not_checked():
    alone = Sums(10, (GOOD, BAD, WORSE, OTHER), (0, 1, 2, 3), (0, 1, 2, 3))
    assert judge(alone) == ()
    assert decide(ReplicaState(), alone, CONFIG)[1] == [Verified(10)]
    assert coverage((0, 1, 2, 3)).startswith("no replicas")
    assert coverage(()).startswith("no replicas")
    assert "2 replicas" in coverage((0, 0)) and "spare" in coverage((0, 0))
    assert "majority" in coverage((0, 1, 0, 1, 0, 1))
    assert "1 rank(s) alone" in coverage((0, 0, 1))


def test_sums_must_be_one_per_rank():
    with pytest.raises(ValueError):
        Sums(1, (GOOD,), (0, 0), (0, 1))
    with pytest.raises(ValueError):
        Sums(1, (GOOD, GOOD), (0, 0), (1, 1))


# ---------------------------------------------------------------- two replicas
def _split(state=AT_10, **kw):
    state, actions = decide(state, ddp(20, GOOD, BAD, slots=(4, 7), **kw), CONFIG)
    assert actions == [Mismatch(20, 10, (), (0,), Resolution.UNRESOLVED),
                       Rollback(10, replay=True)]
    assert state.pending == Pending(20, (4, 7), (0,), (GOOD, BAD))
    return state


def test_two_replicas_transient():
    state = _split()
    state, actions = decide(state, ddp(20, GOOD, GOOD, slots=(4, 7)), CONFIG)
    assert actions == [Mismatch(20, 10, (7,), (0,), Resolution.RECOMPUTE),
                       Settled(20, transient=True, by=Resolution.RECOMPUTE), Verified(20)]
    assert state == ReplicaState(last_verified=20)


def test_a_transient_that_moved_both_blames_nobody():
    state, actions = decide(_split(), ddp(20, OTHER, OTHER, slots=(4, 7)), CONFIG)
    assert actions[0] == Mismatch(20, 10, (), (0,), Resolution.RECOMPUTE)
    assert actions[-1] == Verified(20)


def test_two_replicas_persistent_the_spare_blames_the_drained_slot():
    state = _split()
    state, actions = decide(state, ddp(20, GOOD, BAD, slots=(4, 7), spare_ready=True), CONFIG)
    assert actions == [Mismatch(20, 10, (), (0,), Resolution.UNRESOLVED), NeedVote(7),
                       Rollback(10, replay=True)]
    assert state.pending == Pending(20, (4, 7), (0,), (GOOD, BAD), Stage.VOTE)
    # The spare took slot 7 and replayed: it agrees with slot 4.
    state, actions = decide(state, ddp(20, GOOD, GOOD, slots=(4, 7)), CONFIG)
    assert actions == [Mismatch(20, 10, (7,), (0,), Resolution.SPARE),
                       Settled(20, transient=False, by=Resolution.SPARE), Verified(20)]
    assert state == ReplicaState(last_verified=20)


def test_two_replicas_persistent_the_spare_blames_the_other_slot():
    state = _split()
    state, _ = decide(state, ddp(20, GOOD, BAD, slots=(4, 7), spare_ready=True), CONFIG)
    # Slot 4 is the faulty one: the spare in slot 7 computes what slot 7 computed.
    state, actions = decide(state, ddp(20, GOOD, BAD, slots=(4, 7), spare_sum=BAD), CONFIG)
    assert actions == [Mismatch(20, 10, (4,), (0,), Resolution.SPARE),
                       Settled(20, transient=False, by=Resolution.SPARE),
                       Rollback(10, replay=False), Replace((4,))]
    assert state == AT_10


def test_a_spare_sum_given_at_the_recompute_decides_at_once():
    state = _split()
    state, actions = decide(state, ddp(20, GOOD, BAD, slots=(4, 7), spare_sum=GOOD), CONFIG)
    # Slot 7 is still in the run: it is replaced, and its gradients tainted everyone.
    assert actions == [Mismatch(20, 10, (7,), (0,), Resolution.SPARE),
                       Settled(20, transient=False, by=Resolution.SPARE),
                       Rollback(10, replay=False), Replace((7,))]
    assert state == AT_10


def test_a_vote_for_neither_stops():
    state = _split()
    state, _ = decide(state, ddp(20, GOOD, BAD, slots=(4, 7), spare_ready=True), CONFIG)
    _, actions = decide(state, ddp(20, GOOD, WORSE, slots=(4, 7)), CONFIG)
    assert isinstance(actions[-1], Stop) and "neither" in actions[-1].reason


def test_two_replicas_persistent_without_a_spare_stop():
    state = _split()
    state, actions = decide(state, ddp(20, GOOD, BAD, slots=(4, 7)), CONFIG)
    assert actions == [Mismatch(20, 10, (), (0,), Resolution.UNRESOLVED),
                       Stop("unresolved SDC between slots 4 and 7: no spare to cast the "
                            "third vote")]
    assert state.pending is None


def test_a_persistent_split_of_many_stops():
    state, _ = decide(AT_10, ddp(20, GOOD, GOOD, BAD, BAD), CONFIG)
    _, actions = decide(state, ddp(20, GOOD, GOOD, BAD, BAD, spare_ready=True), CONFIG)
    assert isinstance(actions[-1], Stop)


def test_a_check_past_the_disputed_step_is_judged_afresh():
    state = _split()
    state, actions = decide(state, ddp(30, GOOD, GOOD, slots=(4, 7)), CONFIG)
    assert actions == [Verified(30)] and state == ReplicaState(last_verified=30)


def test_nothing_verified_yet_rolls_back_to_the_start():
    _, actions = decide(ReplicaState(), ddp(5, GOOD, GOOD, BAD), CONFIG)
    assert Rollback(None, replay=False) in actions


# ---------------------------------------------------------------- REPORT
def test_report_only_reports_and_verifies_nothing_after():
    state, actions = decide(AT_10, ddp(20, GOOD, GOOD, BAD), REPORT)
    assert actions == [Mismatch(20, 10, (2,), (0,), Resolution.MAJORITY)]
    assert state == ReplicaState(last_verified=10, unverified_since=20)
    state, actions = decide(state, ddp(30, GOOD, BAD), REPORT)
    assert actions == [Mismatch(30, 10, (), (0,), Resolution.UNRESOLVED)]
    assert state.pending is None
    state, actions = decide(state, ddp(40, GOOD, GOOD), REPORT)
    assert actions == [] and state == ReplicaState(last_verified=10, unverified_since=20)


def test_report_verifies_while_clean():
    assert decide(ReplicaState(), ddp(10, GOOD, GOOD), REPORT) == (AT_10, [Verified(10)])


# ---------------------------------------------------------------- when
@pytest.mark.parametrize("check_s, step_s, copy_every, config, expected", [
    (0.1, 1.0, None, SdcConfig(every=7), (7, "configured")),
    (0.1, 1.0, None, CONFIG, (20, "budget")),  # 0.1 / 0.005
    (0.1, 1.0, 100, CONFIG, (25, "budget")),  # 0.1 / (0.005 - 0.001)
    (0.001, 1.0, None, CONFIG, (1, "budget")),
    (0.0, 1.0, 10, CONFIG, (1, "budget")),
    (1.0, 1.0, None, CONFIG, (100, "cap")),  # 200, capped
    (1.0, 1.0, 200, CONFIG, (100, "copy-step checks alone exceed the budget")),  # room 0
    (1.0, 1.0, 100, CONFIG, (100, "copy-step checks alone exceed the budget")),
    (0.2, 1.0, None, SdcConfig(cap=30), (30, "cap")),
])
def test_the_interval(check_s, step_s, copy_every, config, expected):
    assert interval(check_s, step_s, copy_every, config) == expected


def test_the_interval_refuses_nonsense():
    with pytest.raises(ValueError):
        interval(-1.0, 1.0, None, CONFIG)
    with pytest.raises(ValueError):
        interval(0.1, 1.0, 0, CONFIG)


def test_due_at_multiples_and_copy_steps():
    assert [s for s in range(1, 31) if due(s, None, 10, copy_steps=False)][:1] == [10]
    assert [s for s in range(11, 31) if due(s, 10, 10, copy_steps=False)][:1] == [20]
    assert not due(17, 16, 17, copy_steps=False)  # K grew from 16 to 17: not a step later
    assert due(13, 10, 10, copy_steps=True)
