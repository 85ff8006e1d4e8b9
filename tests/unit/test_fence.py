"""The fence before every update (runtime/generations/fence.py): an update is refused when the
generation was aborted or a backend reports an error, passes otherwise, through every way
an optimizer is stepped. No process: the refusal's inputs are what the watchdog and torch's
NCCL backend would give (`get_error()`: a CPU build has no NCCL backend to ask)."""

from __future__ import annotations

import pytest
import torch
from torch._C._distributed_c10d import ErrorType

from unbroken.errors import ErrorClass, UpdateRefused, classify
from unbroken.runtime.generations.fence import Fence, refusal, unfenceable
from unbroken.runtime.groups.process_group import errors_of
from unbroken.runtime.position import Position
from unbroken.runtime.tracked import TrackedState


class Backend:
    """What `process_group.nccl_errors` asks of an NCCL backend: its `get_error()`."""

    def __init__(self, error: ErrorType) -> None:
        self.error = error

    def get_error(self) -> ErrorType:
        return self.error


def tracked_sgd(aborted=False, errors=()) -> tuple[TrackedState, Fence, torch.nn.Linear]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    tracked = TrackedState(model, [torch.optim.SGD(model.parameters(), lr=0.1)], {})
    fence = Fence(lambda: Position(rank=0, world_size=2, step=4, gen=1),
                  lambda gen: aborted, lambda: list(errors))
    tracked.fence = fence
    model(torch.ones(2, 3)).sum().backward()
    return tracked, fence, model


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_the_refusal_says_why_and_is_none_when_nothing_is_wrong():
    assert refusal(3, aborted=False, errors=[]) is None
    assert "generation 3 was aborted before the update" in refusal(3, True, [])
    assert "(default_pg: REMOTE_ERROR)" in refusal(3, False, ["default_pg: REMOTE_ERROR"])


def test_a_backend_reporting_a_remote_error_is_named_and_success_is_not():
    named = errors_of([("default_pg", Backend(ErrorType.REMOTE_ERROR)),
                       ("ckpt", Backend(ErrorType.SUCCESS)), ("old", object())])
    assert named == ["default_pg: REMOTE_ERROR"]


@pytest.mark.parametrize("aborted, errors", [(True, ()), (False, ("default_pg: REMOTE_ERROR",))])
def test_an_update_behind_an_aborted_or_failed_generation_is_refused_and_the_state_stays_whole(
        aborted, errors):
    tracked, _, model = tracked_sgd(aborted, errors)
    before = params(model)
    with pytest.raises(UpdateRefused) as refused, tracked.updating():
        tracked.optimizers[0].step()
    assert classify(refused.value) == ErrorClass.PEER  # the engine recovers it in place
    assert all(torch.equal(a, b) for a, b in zip(before, params(model), strict=True))
    assert tracked.whole  # nothing was overwritten: this rank still holds committed state


def test_a_backend_error_read_through_errors_of_refuses_the_update():
    tracked, _, _ = tracked_sgd()
    tracked.fence = Fence(lambda: Position(rank=0, world_size=2, step=0),
                          lambda gen: False,
                          lambda: errors_of([("default_pg", Backend(ErrorType.REMOTE_ERROR))]))
    with pytest.raises(UpdateRefused, match="REMOTE_ERROR"):
        tracked.update()


def test_an_update_that_passes_the_fence_is_made_and_an_error_after_it_tears_the_state():
    tracked, _, model = tracked_sgd()
    before = params(model)
    tracked.update()
    assert tracked.whole and not torch.equal(before[0], params(model)[0])
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(ValueError), tracked.updating():
        tracked.optimizers[0].step()
        raise ValueError("after the update began")
    assert not tracked.whole


def test_a_compiled_optimizer_step_still_passes_through_the_fence():
    tracked, fence, model = tracked_sgd(aborted=True)
    compiled = torch.compile(tracked.optimizers[0].step, backend="eager")
    with pytest.raises(UpdateRefused):
        compiled()
    tracked.fence = Fence(lambda: Position(rank=0, world_size=2, step=4, gen=1),
                          lambda gen: False, lambda: [])
    before = params(model)
    compiled()
    assert not torch.equal(before[0], params(model)[0])


def test_a_step_with_a_closure_is_fenced_by_its_caller_after_the_closure():
    """Lightning runs forward and backward inside `optimizer.step(closure)`: the pre-hook
    passes, and the caller's `begin_update` after the closure refuses."""
    tracked, _, model = tracked_sgd(aborted=True)
    calls = []

    def closure():
        calls.append("closure")
        tracked.begin_update()  # as the Lightning adapter does, after its check
        return None

    with pytest.raises(UpdateRefused), tracked.updating():
        tracked.optimizers[0].step(closure=closure)
    assert calls == ["closure"]


def test_a_cpu_job_has_no_stream_to_drain():
    tracked, fence, _ = tracked_sgd()
    tracked.update()
    assert fence.waits == 0  # a CPU job: nothing to synchronise


def test_optimizers_that_cannot_be_fenced_turn_in_place_off_with_one_line():
    model = torch.nn.Linear(3, 1)
    zero = type("ZeroRedundancyOptimizer", (torch.optim.SGD,), {})(model.parameters(), lr=0.1)
    assert "ZeroRedundancyOptimizer's step holds collectives" in unfenceable([zero], model)
    assert unfenceable([torch.optim.SGD(model.parameters(), lr=0.1)], model) is None
    from torch.distributed.optim import _apply_optimizer_in_backward

    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    assert "steps inside backward" in unfenceable([], model)


def test_a_refusal_caught_inside_the_update_block_leaves_the_state_whole():
    """The Trainer's update spans two callbacks (`updating()` opens at
    `on_pre_optimizer_step`): the adapter catches the refusal inside the block, and the
    rank still holds its committed state when it leaves."""
    tracked, _, _ = tracked_sgd(aborted=True)
    with tracked.updating():
        with pytest.raises(UpdateRefused):
            tracked.optimizers[0].step()
        assert tracked.whole
