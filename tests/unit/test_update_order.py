"""The order of an update's calls that the Trainer integration relies on
(integrations/update_order.py): the Trainer's as it is, and each way it could break."""

from __future__ import annotations

import pytest

from unbroken.integrations.update_order import Call, UpdateOrder

C, M, K, P, OPT, E = Call.COUNT, Call.MICRO, Call.CLIP, Call.PRE_OPTIMIZER, Call.OPTIMIZER, Call.STEP_END


def feed(order: UpdateOrder, calls) -> str | None:
    for call in calls:
        kind, detail = call if isinstance(call, tuple) else (call, {})
        if (broken := order.saw(kind, **detail)) is not None:
            return broken
    return None


def update(k: int, step: int, clip: bool = True) -> list:
    return [(C, {"batches": k}), *[M] * k, *([K] if clip else []), P, OPT, (E, {"global_step": step})]


def test_the_trainers_order_holds_and_only_the_first_updates_are_checked():
    order = UpdateOrder(accumulation=2, clips=True)
    assert feed(order, update(2, 1) + update(2, 2)) is None
    assert not order.checking and order.checked == 2
    assert feed(order, [P, P, P]) is None  # past the first two: nothing is checked


def test_the_last_update_of_an_epoch_may_count_fewer_micro_batches():
    order = UpdateOrder(accumulation=4, clips=False, updates=3)
    assert feed(order, update(4, 1, clip=False) + update(1, 2, clip=False)) is None


@pytest.mark.parametrize("calls, says", [
    (update(3, 1), "update 1: the item count was taken over 3 micro-batch(es), not 1 to 2"),
    ([M], "update 1: micro came before the update's item count"),
    ([(C, {"batches": 2}), M, K], "the clipping came after 1 of 2 micro-batches"),
    ([(C, {"batches": 2}), M, P], "on_pre_optimizer_step came after 1 of 2 micro-batches"),
    ([(C, {"batches": 2}), M, M, M], "a training_step came after micro, or past the 2 counted"),
    ([(C, {"batches": 2}), M, M, P], "on_pre_optimizer_step came after micro, not after the clipping"),
    ([(C, {"batches": 2}), M, M, K, OPT], "optimizer came after clip, not after pre_optimizer"),
    ([(C, {"batches": 2}), M, M, K, P, (E, {"global_step": 1})], "step_end came after pre_optimizer"),
    ([(C, {"batches": 2}), M, M, K, P, OPT, OPT], "optimizer came twice in one update"),
    (update(2, 1) + update(2, 3), "update 2: global_step went from 1 to 3 in one update"),
    ([(C, {"batches": 2}), M, (C, {"batches": 2})], "the item count came after micro within the update"),
])
def test_each_broken_invariant_is_named_once(calls, says):
    order = UpdateOrder(accumulation=2, clips=True)
    broken = feed(order, calls)
    assert broken is not None and says in broken
    assert not order.checking and order.saw(Call.COUNT, batches=1) is None  # said once


def scheduled(k: int, step: int, at: int, stepped: int = 1, early: int = 0) -> list:
    """An update whose scheduler stands at `at` at the count, `at + early` at the optimizer
    step and `at + early + stepped` at on_step_end."""
    return [(C, {"batches": k, "scheduler_at": at}), *[M] * k, K, P,
            (OPT, {"scheduler_at": at + early}),
            (E, {"global_step": step, "scheduler_at": at + early + stepped})]


def test_a_scheduler_stepped_once_between_the_optimizer_step_and_step_end_holds():
    order = UpdateOrder(accumulation=2, clips=True, schedules=True)
    assert feed(order, scheduled(2, 1, 0) + scheduled(2, 2, 1)) is None
    assert order.checked == 2


@pytest.mark.parametrize("calls, says", [
    (scheduled(2, 1, 0, stepped=0), "the scheduler did not step between the optimizer step"),
    (scheduled(2, 1, 0, stepped=0, early=1), "the scheduler stepped before the optimizer step"),
    (scheduled(2, 1, 0) + scheduled(2, 2, 1, stepped=0), "update 2: the scheduler did not step"),
])
def test_a_scheduler_out_of_place_is_named(calls, says):
    order = UpdateOrder(accumulation=2, clips=True, schedules=True)
    broken = feed(order, calls)
    assert broken is not None and says in broken, broken


def test_without_a_per_update_scheduler_its_count_is_not_checked():
    order = UpdateOrder(accumulation=2, clips=True, schedules=False)
    assert feed(order, scheduled(2, 1, 0, stepped=0) + scheduled(2, 2, 0, stepped=0)) is None
