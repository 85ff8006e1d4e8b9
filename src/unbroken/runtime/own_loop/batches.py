"""The loader's batches as a function of the step: the same batch again after a recovery.

A survivor that redoes a step gets the batch it drew for that step (kept until the step
commits); a rank that stands at another step (resumed from a checkpoint, rolled back, a
replacement or promoted spare that joined) is positioned there: the micro-batch index
`step * micro_batches` is an epoch and an offset in it, the sampler is given that epoch
(`set_epoch`), and the offset's batches are drawn and dropped. That is exact for a
`DataLoader` whose sampler is a `DistributedSampler` or a `SequentialSampler`, and for one
Accelerate prepared over a sequential or seedable sampler: its batches are a function of
(epoch, rank) alone. A promoted spare's sampler is re-made for the rank it took. A stateful
loader (torchdata's `StatefulDataLoader`) is positioned by its state instead, whatever it
iterates (`loader_state`: a rank's marks, published for whoever takes the rank). Any other
iterable cannot be positioned (`unpositionable` says why, in one line): its job restarts on
a fault, as under torchrun, and the loader is simply iterated.

`unpositionable` is pure; `Batches` draws from the loader.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
)

from unbroken.errors import UserError
from unbroken.runtime.own_loop.loader_state import Mark, MarkStore, stateful
from unbroken.telemetry import schema as ev


def unpositionable(loader: Any) -> str | None:
    """Why `loader`'s batch at a given step cannot be known, or None. Pure."""
    if stateful(loader) and accelerate_shard(loader) is None:
        if type(getattr(loader, "sampler", None)) is RandomSampler:
            return ("torch's RandomSampler in a stateful loader is re-seeded when its state is "
                    "loaded, not restored (pass shuffle=True: torchdata's own sampler keeps its "
                    "generator in the state)")
        return None
    if not isinstance(loader, DataLoader):
        return (f"the data ({type(loader).__name__}) is not a torch DataLoader, so the batch "
                "of a redone step cannot be drawn again")
    shard = accelerate_shard(loader)
    batches = shard.batch_sampler if shard is not None else loader.batch_sampler
    if batches is None or type(batches) is not BatchSampler:
        return "the DataLoader has a batch sampler of its own, which cannot be positioned"
    sampler = batches.sampler
    if isinstance(sampler, (DistributedSampler, SequentialSampler)) or _seedable(sampler):
        return None
    if shard is not None:
        return ("Accelerate's prepared DataLoader shuffles with a generator it synchronises "
                "between processes each epoch, so its batches are not a function of the epoch "
                "(give Accelerator dataloader_config=DataLoaderConfiguration("
                "use_seedable_sampler=True))")
    return (f"the DataLoader's sampler ({type(sampler).__name__}) is neither a "
            "DistributedSampler nor a SequentialSampler, so its batches are not a "
            "function of the epoch (pass sampler=DistributedSampler(dataset))")


def accelerate_shard(loader: Any) -> Any:
    """The per-process batch sampler of a loader Accelerate prepared (`DataLoaderShard`: it
    counts its epochs in `iteration` and shards batches by `process_index`), or None."""
    if not (hasattr(loader, "iteration") and hasattr(loader, "skip_batches")):
        return None
    shard = getattr(loader, "batch_sampler", None)
    return shard if hasattr(shard, "process_index") and hasattr(shard, "batch_sampler") else None


def _seedable(sampler: Any) -> bool:
    """A shuffling sampler whose order is a function of (seed, epoch): Accelerate's
    `SeedableRandomSampler` (its generator re-seeded with `initial_seed + epoch`)."""
    return all(hasattr(sampler, name) for name in ("initial_seed", "epoch", "set_epoch"))


def epoch_and_offset(micro: int, per_epoch: int) -> tuple[int, int]:
    """The epoch and the batch within it of the `micro`-th batch of the run. Pure."""
    if per_epoch <= 0:
        raise UserError("run.steps(data=...): the data loader yields no batch")
    return divmod(micro, per_epoch)


class Batches:
    """Draws a step's batch (or its `micro_batches` batches, as a list) from a loader."""

    def __init__(self, loader: Any, micro_batches: int | None, rank: Callable[[], int],
                 world_size: Callable[[], int], record: Callable[..., None] = lambda e: None,
                 marks: MarkStore | None = None) -> None:
        """`micro_batches`: a step's batches, as a list (None: one, not in a list). `rank()`,
        `world_size()`: this worker's, now (a promoted spare's change). `marks`: where a
        stateful loader's marks are published and fetched (None: kept here only)."""
        if micro_batches is not None and micro_batches < 1:
            raise UserError(f"run.steps(micro_batches=...): must be >= 1, got {micro_batches}")
        self.loader, self.micro_batches = loader, micro_batches or 1
        self._listed = micro_batches is not None
        self.why_not = unpositionable(loader)
        """Why the loader cannot be positioned (one line), or None."""
        self._rank, self._world_size = rank, world_size
        self._record, self.marks = record, marks
        self.stateful = self.why_not is None and stateful(loader) and \
            accelerate_shard(loader) is None
        """Positioned by its state (`loader_state`), not by its epoch."""
        self._first = Mark(0, 0, 0, 0, loader.state_dict()) if self.stateful else None
        self._mark: Mark | None = None  # the state before the step drawn last (stateful)
        if self.why_not is None and accelerate_shard(loader) is not None:
            # Its generator's state is broadcast from process 0 at each epoch's start: a
            # collective in the data that a rank seeking alone would call alone. The order
            # is a function of (seed, epoch) here (`unpositionable`): the broadcast adds
            # nothing, so it is left out.
            loader.rng_types = None
        self._step = -1  # the step whose batch is `_current`
        self._current: Any = None
        self._next_micro = -1  # the micro-batch index `_it` yields next (-1: none open)
        self._epoch = 0
        self._it: Iterator[Any] | None = None

    @property
    def sampler(self) -> DistributedSampler | None:
        sampler = getattr(self.loader, "sampler", None)
        return sampler if isinstance(sampler, DistributedSampler) else None

    @property
    def by_rank(self) -> bool:
        """The batches are this rank's share of a world of fixed size (a DistributedSampler,
        Accelerate's shard): the world size must never change."""
        return self.sampler is not None or accelerate_shard(self.loader) is not None or \
            self.stateful

    def at(self, step: int) -> Any:
        """Step `step`'s batch; the same object again while `step` has not committed."""
        if step == self._step:
            return self._current
        k = self.micro_batches
        if self._next_micro != step * k:
            self._seek(step * k)
        if self.stateful:
            self._mark = Mark(step * k, self._epoch, self._rank(), self._world_size(),
                              self.loader.state_dict())
            if self.marks is not None:
                self.marks.publish(self._mark)
        drawn = [self._draw() for _ in range(k)]
        self._step, self._current = step, drawn if self._listed else drawn[0]
        return self._current

    def forget(self) -> None:
        """The state went elsewhere (a rollback, a switch): position again at the next step."""
        self._step, self._next_micro = -1, -1

    def _seek(self, micro: int) -> None:
        """Stand before the `micro`-th batch of the run."""
        if self.why_not is not None:  # a restart's loader: iterated as the script would
            if self._it is None:
                self._it = iter(self.loader)
            self._next_micro = micro
            return
        if self.stateful:
            self._seek_state(micro)
            return
        self._retarget()
        epoch, offset = epoch_and_offset(micro, len(self.loader))
        self._open(epoch)
        for _ in range(offset):
            next(self._it)
        self._next_micro = micro

    def _seek_state(self, micro: int) -> None:
        """Load the newest usable mark at or before `micro`; draw and drop the rest."""
        t0 = time.monotonic()
        source, mark = self._usable_mark(micro, self._rank(), self._world_size())
        self.loader.load_state_dict(mark.state)
        self._open(mark.epoch)
        self._next_micro = mark.micro
        while self._next_micro < micro:
            self._draw()
        if micro > 0:
            k = self.micro_batches
            self._record(ev.LoaderPositioned(step=micro // k, mark=source,
                                             dropped=micro - mark.micro,
                                             seconds=round(time.monotonic() - t0, 6)))

    def _usable_mark(self, micro: int, rank: int, world: int) -> tuple[str, Mark]:
        """This worker's own mark, else the rank's in the store, else the loader's first
        state: the newest that serves (`Mark.serves`)."""
        if self._mark is not None and self._mark.serves(micro, rank, world):
            return "own", self._mark
        if self.marks is not None and micro > 0:
            got = self.marks.fetch(rank)
            if got is not None and got.serves(micro, rank, world):
                return "store", got
        assert self._first is not None
        return "start", replace(self._first, rank=rank, world_size=world)

    def _retarget(self) -> None:
        """Make the sampler this rank's (a promoted spare's was made for rank 0)."""
        sampler = self.sampler
        rank, world = self._rank(), self._world_size()
        if (shard := accelerate_shard(self.loader)) is not None:
            shard.process_index, shard.num_processes = rank, world
        if sampler is not None and (sampler.rank, sampler.num_replicas) != (rank, world):
            DistributedSampler.__init__(sampler, sampler.dataset, num_replicas=world, rank=rank,
                                        shuffle=sampler.shuffle, seed=sampler.seed,
                                        drop_last=sampler.drop_last)

    def _open(self, epoch: int) -> None:
        self._epoch = epoch
        if accelerate_shard(self.loader) is not None:
            self.loader.set_epoch(epoch)  # its `iteration`, which its `__iter__` applies
        elif hasattr(self.loader.sampler, "set_epoch"):
            self.loader.sampler.set_epoch(epoch)
        self._it = iter(self.loader)

    def _draw(self) -> Any:
        assert self._it is not None
        try:
            batch = next(self._it)
        except StopIteration:  # the epoch ended: the next one, with its own order
            if self.why_not is None:
                self._open(self._epoch + 1)
            else:
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:
                raise UserError("run.steps(data=...): the data loader yields no batch") from None
        self._next_micro += 1
        return batch
