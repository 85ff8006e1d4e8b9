"""The user's own loop (runtime/own_loop/): the batch of a step, drawn again on a redo and
positioned anywhere; a try of a step and where it commits; the tracked scheduler stepped once
per committed step. No process: real DataLoaders, optimizers and schedulers, and an engine
stand-in that records what the block asks of it."""

from __future__ import annotations

import base64
import pickle

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torchdata.stateful_dataloader import StatefulDataLoader

from unbroken.errors import UserError
from unbroken.runtime.engine import Verdict
from unbroken.runtime.own_loop.batches import Batches, epoch_and_offset, unpositionable
from unbroken.runtime.own_loop.loader_state import Mark, decode_state, encode_state, stateful
from unbroken.runtime.own_loop.step_block import StepBlock, StepSettled, guard_scheduler
from unbroken.runtime.tracked import TrackedState

DATA = TensorDataset(torch.arange(20).float())


def sampler_loader(rank: int = 1, world: int = 2, seed: int = 3) -> DataLoader:
    sampler = DistributedSampler(DATA, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return DataLoader(DATA, batch_size=3, sampler=sampler)


def batches(loader, micro=None, rank=1, world=2) -> Batches:
    return Batches(loader, micro, lambda: rank, lambda: world)


def ids(batch) -> list[float]:
    return batch[0].tolist()


# ---------------------------------------------------------------------- the batches
def test_a_redone_step_gets_the_same_batch_object_and_the_next_step_the_next_batch():
    b = batches(DataLoader(DATA, batch_size=4))
    first = b.at(0)
    assert b.at(0) is first
    assert ids(b.at(1)) == [4.0, 5.0, 6.0, 7.0]


def test_any_step_is_positioned_as_if_every_step_before_it_had_been_drawn():
    """Epochs of 4 batches (10 samples a rank, 3 a batch): steps 0-13 in a row, against a
    fresh loader (a replacement's) jumping to each step, across epoch boundaries, where the
    sampler's order changes with the epoch."""
    row = batches(sampler_loader())
    drawn = [ids(row.at(s)) for s in range(14)]
    assert drawn[0] != drawn[4]  # epoch 1 is shuffled otherwise than epoch 0
    for step in (0, 3, 4, 9, 13):
        assert ids(batches(sampler_loader()).at(step)) == drawn[step], step


def test_after_a_rollback_the_earlier_step_is_drawn_again():
    b = batches(sampler_loader())
    drawn = [ids(b.at(s)) for s in range(6)]
    assert ids(b.at(2)) == drawn[2]
    assert ids(b.at(3)) == drawn[3]


def test_a_promoted_spares_sampler_is_remade_for_the_rank_it_took():
    spare_loader = sampler_loader(rank=0)  # a spare's script ran in a world where it was 0
    assert ids(batches(spare_loader, rank=1).at(5)) == ids(batches(sampler_loader(rank=1)).at(5))
    assert spare_loader.sampler.rank == 1


def test_micro_batches_come_as_a_list_and_again_as_the_same_list():
    b = batches(DataLoader(DATA, batch_size=2), micro=2)
    step0 = b.at(0)
    assert [ids(m) for m in step0] == [[0.0, 1.0], [2.0, 3.0]] and b.at(0) is step0
    assert [ids(m) for m in b.at(1)] == [[4.0, 5.0], [6.0, 7.0]]
    assert len(batches(DataLoader(DATA, batch_size=2), micro=1).at(0)) == 1


def test_what_cannot_be_positioned_is_said_in_one_line():
    assert unpositionable(DataLoader(DATA, batch_size=2)) is None
    assert unpositionable(sampler_loader()) is None
    assert "not a torch DataLoader" in unpositionable(iter([1, 2]))
    assert "RandomSampler" in unpositionable(DataLoader(DATA, batch_size=2, shuffle=True))
    own = BatchSampler(SequentialSampler(DATA), 2, False)

    class Mine(BatchSampler):
        pass

    assert unpositionable(DataLoader(DATA, batch_sampler=own)) is None
    assert "batch sampler of its own" in unpositionable(
        DataLoader(DATA, batch_sampler=Mine(SequentialSampler(DATA), 2, False)))
    for why in (unpositionable(iter([])), unpositionable(DataLoader(DATA, shuffle=True))):
        assert "\n" not in why


def test_an_unpositionable_loader_is_iterated_as_the_script_would():
    b = batches(iter([[1], [2], [3]]))
    assert b.why_not is not None
    assert [b.at(s) for s in range(3)] == [[1], [2], [3]]


def test_a_loader_with_no_batch_and_bad_arguments_are_user_errors():
    with pytest.raises(UserError, match="yields no batch"):
        batches(DataLoader(TensorDataset(torch.zeros(0)), batch_size=2)).at(0)
    with pytest.raises(UserError, match="micro_batches"):
        batches(DataLoader(DATA), micro=0)
    assert epoch_and_offset(9, 4) == (2, 1)


# ---------------------------------------------------------------------- the scheduler
def test_a_guarded_scheduler_steps_only_when_the_runtime_steps_it():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    runtime_step = guard_scheduler(scheduler)
    optimizer.step()
    scheduler.step()
    scheduler.step()
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1.0
    runtime_step()
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == 0.5
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    state = scheduler.state_dict()
    assert not any(callable(v) for k, v in state.items() if k != "lr_lambdas"), state
    scheduler.load_state_dict(state)


# ---------------------------------------------------------------------- a try of a step
class Engine:
    """What a `StepBlock` asks of the engine, recorded; `fail` recovers unless told not to."""

    def __init__(self, verdict: Verdict = Verdict.COMMIT, recovers: bool = True) -> None:
        self.verdict, self.recovers, self.calls = verdict, recovers, []

    def check(self, step, metrics):
        self.calls.append(("check", step))
        return self.verdict

    def commit(self, step, metrics, settle=True):
        self.calls.append(("commit", step, settle))

    def fail(self, step, exc):
        self.calls.append(("fail", step, type(exc).__name__))
        if not self.recovers:
            raise exc


def two_optimizers(engine: Engine):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opts = [torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)]
    scheduler = torch.optim.lr_scheduler.StepLR(opts[0], step_size=1, gamma=0.5)
    tracked = TrackedState(model, opts, {"scheduler": scheduler})
    block = StepBlock(engine, tracked, {})
    block.open(7, {})
    return block, tracked, model, opts, scheduler


def backward(model) -> None:
    model(torch.ones(2, 3)).sum().backward()


def test_the_step_commits_when_the_last_tracked_optimizer_has_stepped():
    engine = Engine()
    block, tracked, model, opts, scheduler = two_optimizers(engine)
    with block:
        backward(model)
        opts[0].step()
        assert not tracked.whole and not block.committed  # torn between the two updates
        opts[1].step()
        assert tracked.whole and block.committed
        scheduler.step()  # the user's: the runtime stepped it at the commit
    assert engine.calls == [("check", 7), ("commit", 7, False)]
    assert scheduler.last_epoch == 1 and not block.handled


def test_a_fault_before_the_commit_goes_to_the_engine_and_the_block_swallows_it():
    engine = Engine()
    block, tracked, model, opts, _ = two_optimizers(engine)
    before = model.weight.detach().clone()
    with block:
        backward(model)
        raise RuntimeError("Connection closed by peer")
    assert engine.calls == [("fail", 7, "RuntimeError")]
    assert block.handled and not block.committed and torch.equal(model.weight, before)


def test_a_fault_after_the_commit_is_recovered_as_committed():
    engine = Engine()
    block, tracked, model, opts, _ = two_optimizers(engine)
    with block:
        backward(model)
        opts[0].step()
        opts[1].step()
        raise RuntimeError("the loop's own all-reduce: Connection closed by peer")
    assert engine.calls[-2:] == [("commit", 7, False), ("fail", 7, "RuntimeError")]
    assert block.committed and block.handled


def test_what_recovery_cannot_help_propagates_and_so_does_an_interrupt():
    block, *_ = two_optimizers(Engine(recovers=False))
    with pytest.raises(ValueError, match="the user's"), block:
        raise ValueError("the user's")
    block, *_ = two_optimizers(Engine())
    with pytest.raises(KeyboardInterrupt), block:
        raise KeyboardInterrupt


def test_a_verdict_other_than_commit_stops_the_update_past_the_users_except():
    engine = Engine(verdict=Verdict.RERUN)
    block, tracked, model, opts, scheduler = two_optimizers(engine)
    before = model.weight.detach().clone()
    with block:
        backward(model)
        try:
            opts[0].step()
        except Exception:  # noqa: BLE001  (a user's catch-all must not swallow the verdict)
            pytest.fail("StepSettled was caught as an Exception")
        pytest.fail("the block went on after the verdict")
    assert block.handled and not block.committed
    assert torch.equal(model.weight, before) and tracked.whole
    assert engine.calls == [("check", 7)] and scheduler.last_epoch == 0
    assert issubclass(StepSettled, BaseException) and not issubclass(StepSettled, Exception)


def test_a_block_that_ends_without_an_update_commits_a_step_without_one():
    engine = Engine()
    block, tracked, model, opts, scheduler = two_optimizers(engine)
    with block:
        backward(model)  # a GradScaler found an Inf and skipped optimizer.step()
    assert engine.calls == [("commit", 7, False)] and block.committed
    assert scheduler.last_epoch == 1


def test_a_block_outside_the_loop_or_twice_in_a_step_is_a_user_error():
    block, *_ = two_optimizers(Engine())
    block.close()
    with pytest.raises(UserError, match="belongs inside the loop"), block:
        pass
    block.open(8, {})
    with block:
        pass
    with pytest.raises(UserError, match="one block per step"), block:
        pass


def test_updates_outside_the_block_are_not_the_blocks():
    engine = Engine()
    block, tracked, model, opts, _ = two_optimizers(engine)
    backward(model)
    opts[0].step()
    opts[1].step()
    assert engine.calls == [] and not block.committed and tracked.whole


def test_a_second_loop_over_the_same_scheduler_and_optimizers_steps_them_once():
    engine = Engine()
    block, tracked, model, opts, scheduler = two_optimizers(engine)
    block.detach()
    again = StepBlock(engine, tracked, {})
    again.open(9, {})
    with again:
        backward(model)
        opts[0].step()
        opts[1].step()
    assert scheduler.last_epoch == 1  # once, by the runtime: not twice, not zero times
    assert engine.calls == [("check", 9), ("commit", 9, False)]


# ---------------------------------------------------------------------- Accelerate's objects
def accelerate_loader(sampler, rank: int):
    """A loader as `Accelerator.prepare` makes it: a DataLoaderShard over a BatchSamplerShard,
    the generator it synchronises each epoch named."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderShard

    shard = BatchSamplerShard(BatchSampler(sampler, 2, False), num_processes=2, process_index=rank)
    return DataLoaderShard(DATA, batch_sampler=shard, rng_types=["generator"],
                           synchronized_generator=getattr(sampler, "generator", None))


def test_an_accelerate_loader_over_a_seedable_sampler_is_positioned_at_any_step():
    from accelerate.data_loader import SeedableRandomSampler

    def loader():
        return accelerate_loader(SeedableRandomSampler(DATA, data_seed=5), rank=0)

    assert unpositionable(loader()) is None
    row = batches(loader(), rank=0)
    drawn = [ids(row.at(s)) for s in range(12)]
    assert drawn[0] != drawn[5]  # 5 batches an epoch: epoch 1 is shuffled otherwise
    for step in (4, 5, 11):
        assert ids(batches(loader(), rank=0).at(step)) == drawn[step], step
    assert row.loader.rng_types is None  # no per-epoch broadcast a joiner would call alone


def test_a_spares_accelerate_shard_is_retargeted_and_shuffling_by_a_synchronised_generator_is_said():
    spare = accelerate_loader(SequentialSampler(DATA), rank=0)
    assert ids(batches(spare, rank=1).at(2)) == ids(
        batches(accelerate_loader(SequentialSampler(DATA), rank=1)).at(2))
    shuffled = accelerate_loader(RandomSampler(DATA, generator=torch.Generator()), rank=0)
    assert "use_seedable_sampler=True" in unpositionable(shuffled)


def test_a_wrapped_optimizer_is_tracked_as_the_one_it_steps_and_a_wrapped_scheduler_is_stepped():
    from unbroken.runtime.own_loop.step_block import stepped_per_update

    class Wrapper:  # the shape of Accelerate's AcceleratedOptimizer / AcceleratedScheduler
        def __init__(self, inner) -> None:
            self.optimizer = self.scheduler = inner

    model = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert TrackedState(model, [Wrapper(sgd)], {}).optimizers == [sgd]
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0)
    assert stepped_per_update(lambda_lr) and stepped_per_update(Wrapper(lambda_lr))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(sgd)
    assert not stepped_per_update(plateau) and not stepped_per_update(Wrapper(plateau))


# ---------------------------------------------------------------- a stateful loader

class ShelfStore:
    """The control store's marks, as `MarkStore` keeps them (newest per rank), in memory."""

    def __init__(self) -> None:
        self.marks: dict[int, Mark] = {}
        self.publishing = True

    def publish(self, mark: Mark) -> None:
        if self.publishing:
            self.marks[mark.rank] = mark

    def fetch(self, rank: int) -> Mark | None:
        return self.marks.get(rank)

    def close(self) -> None:
        pass


def stateful_loader(rank: int = 1, world: int = 2) -> StatefulDataLoader:
    """Shuffled by torchdata's own sampler (its generator in the loader's state)."""
    g = torch.Generator().manual_seed(7 + rank)
    return StatefulDataLoader(DATA, batch_size=3, shuffle=True, generator=g)


def test_a_stateful_loader_is_positioned_by_its_state_whatever_its_sampler():
    assert stateful(stateful_loader()) and not stateful(DataLoader(DATA))
    reseeded = StatefulDataLoader(DATA, sampler=RandomSampler(DATA))  # restored by re-seeding
    assert "shuffle=True" in unpositionable(reseeded) and "\n" not in unpositionable(reseeded)
    assert unpositionable(stateful_loader()) is None  # a RandomSampler: by state, not epoch
    assert batches(stateful_loader()).by_rank  # its state is the rank's: the world is fixed
    reference = [ids(b) for b in (batches(stateful_loader()).at(s) for s in range(17))]
    for start in (0, 3, 6, 7, 13):  # inside epochs and on their ends (7 batches an epoch)
        b = batches(stateful_loader())
        assert [ids(b.at(s)) for s in range(start, 17)] == reference[start:], start


def test_a_joiner_loads_the_ranks_newest_mark_and_draws_only_what_it_lags():
    store, seen = ShelfStore(), []
    dead = Batches(stateful_loader(), None, lambda: 1, lambda: 2, marks=store)
    drawn = [ids(dead.at(s)) for s in range(9)]  # rank 1 published its mark at each step
    assert store.marks[1].micro == 8
    store.publishing = False
    joiner = Batches(stateful_loader(), None, lambda: 1, lambda: 2, seen.append, marks=store)
    assert ids(joiner.at(8)) == drawn[8]
    lagging = Batches(stateful_loader(), None, lambda: 1, lambda: 2, seen.append, marks=store)
    reference = batches(stateful_loader())
    assert [ids(lagging.at(s)) for s in (10, 11)] == [ids(reference.at(s)) for s in (10, 11)]
    assert [(e.mark, e.dropped, e.step) for e in seen] == [("store", 0, 8), ("store", 2, 10)]


def test_a_mark_of_another_rank_world_or_a_later_step_is_never_used():
    store, seen = ShelfStore(), []
    dead = Batches(stateful_loader(), None, lambda: 1, lambda: 2, marks=store)
    for s in range(6):
        dead.at(s)
    store.publishing = False
    reference = batches(stateful_loader())
    for rank, world, step in ((1, 3, 6), (1, 2, 4)):  # another world size; a restart's step
        b = Batches(stateful_loader(), None, lambda r=rank: r, lambda w=world: w, seen.append,
                    marks=store)
        assert ids(b.at(step)) == ids(reference.at(step))
    assert [(e.mark, e.dropped) for e in seen] == [("start", 6), ("start", 4)]
    assert store.fetch(0) is None  # rank 0's place is not rank 1's


def test_a_survivor_redoes_from_its_own_mark_and_the_state_is_loaded_as_tensors_only():
    seen = []
    b = Batches(stateful_loader(), 2, lambda: 1, lambda: 2, seen.append)
    first = [ids(x) for x in b.at(3)]
    b._step = -1  # the state went elsewhere: placed again from its own mark
    b._next_micro = -1
    assert [ids(x) for x in b.at(3)] == first and seen[-1].mark == "own"
    mark = b._mark
    text = encode_state(mark.state)
    assert decode_state(text).keys() == mark.state.keys()
    evil = base64.b64encode(pickle.dumps(Exploit())).decode()
    with pytest.raises(pickle.UnpicklingError):
        decode_state(evil)


class Exploit:
    def __reduce__(self):
        return (print, ("a store's value ran code",))
