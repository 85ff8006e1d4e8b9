"""The generator behind `run.steps(total, data=loader)`: the user's own loop, in place.

    for step, batch in run.steps(total, data=loader):
        with run.try_step():
            ...forward, backward, optimizer.step()...

Each turn of the loop is one try of a step (docs/design-notes.md, "Your own loop"):
1. `engine.begin()`: the step to run (a switch the leader asked for happens first);
2. the step's batch (`Batches.at`: the same one again on a redo), drawn before the step's RNG
   seed so that a redo and a fault-free run draw the same numbers;
3. `engine.enter(step)`: injected faults, the seed; a fault here is recovered like one in
   the block;
4. the try is yielded; the block (`StepBlock`) commits at the update and hands a fault to
   the engine;
5. back in the generator: a try the engine handled (a fault recovered, an anomaly's
   verdict) is simply followed by the next `begin()`; else the step commits (if the block
   has not) and settles: its event, a due checkpoint or snapshot round.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from unbroken.runtime.engine import Engine
from unbroken.runtime.own_loop.batches import Batches
from unbroken.runtime.own_loop.ddp_rebind import cannot_rebind, rebind
from unbroken.runtime.own_loop.loader_state import MarkStore, stateful
from unbroken.runtime.own_loop.step_block import StepBlock

_PROTECTED = ("unbroken: your loop is recovered in place: a peer's fault inside `with "
              "run.try_step():` runs the step again on the same batch")
_NO_BLOCK = ("the loop's body has no `with run.try_step():` block, so a fault inside a step "
             "cannot be caught")


def find_ddp(model: Any) -> DDP | None:
    """The DDP the user trains `model` through: `model` itself, or the DDP object whose
    `module` it is (looked for once, among live objects)."""
    if isinstance(model, DDP):
        return model
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None  # no DDP to find: one process (the heap's scan costs 0.1-1 s)
    return next((obj for obj in gc.get_objects()  # type(): no object's __class__ is asked
                 if issubclass(type(obj), DDP) and obj.module is model), None)


def accumulating() -> str | None:
    """Why Accelerate's own gradient accumulation keeps this loop from being recovered in
    place, or None: `accumulate()` decides when to reduce from a counter of its own, which a
    redone step would advance again. (Accumulate with `micro_batches=k` instead.)"""
    state = sys.modules.get("accelerate.state")
    steps = state.GradientState().num_steps if state is not None else 1
    if steps > 1:
        return (f"Accelerate accumulates gradients over {steps} steps by its own counter "
                "(use run.steps(..., micro_batches=k) with accelerator.no_sync instead)")
    return None


class OwnLoop:
    """One `run.steps(total, data=...)` loop of the user's."""

    def __init__(self, engine: Engine, total: int, data: Any, micro_batches: int | None,
                 fresh_metrics: Callable[[], dict[str, float]],
                 marks: MarkStore | None = None) -> None:
        """`fresh_metrics()`: a new dict for the step's metrics, where `run.log` writes.
        `marks`: the control store's marks of a stateful loader (under an agent)."""
        self.engine, self.total = engine, total
        self.batches = Batches(data, micro_batches, lambda: engine.position.rank,
                               lambda: engine.position.world_size, engine.events.emit,
                               marks if stateful(data) else None)
        self.block: StepBlock | None = None
        self._fresh = fresh_metrics
        self._ddp: DDP | None = None
        self._reuse = True  # generation 0's DDP is the script's own (a joiner's is not)

    def steps(self) -> Iterator[tuple[int, Any]]:
        """Yield (step, batch) for every try, from the committed step up to `total`."""
        engine = self.engine
        tracked = engine.need_tracked("run.steps(data=...)")
        self.block = block = StepBlock(engine, tracked, {})
        self._ddp = find_ddp(tracked.model)
        self._reuse = not engine.joining
        if engine.in_place:
            self._check_in_place()
        if engine.generations is not None and self.batches.by_rank:
            engine.generations.fix_world("the data loader's per-rank shard")
        engine.start(self.total, self._build, lambda step, view: None)
        if engine.in_place and engine.position.rank == 0:
            print(_PROTECTED, file=sys.stderr, flush=True)
        settled, first = engine.position.step, True
        while (step := engine.begin()) is not None:
            batch = self.batches.at(step)
            metrics = self._fresh()
            try:
                engine.enter(step)
            except Exception as exc:
                engine.fail(step, exc)
                continue
            block.open(step, metrics)
            yield step, batch
            block.close()
            if first and not block.used and engine.in_place:
                engine.in_place_unavailable(_NO_BLOCK)
            first = False
            if block.handled:  # a verdict, or a fault recovered (after the commit: its event)
                engine.settle(collectives=False)
                continue
            block.commit()  # no block, or no update: committed as it stands
            engine.settle()
            settled = engine.position.step
        block.detach()
        if self.batches.marks is not None:
            self.batches.marks.close()
        engine.finish(checkpoint=settled != engine.position.step)

    def _check_in_place(self) -> None:
        """Turn in-place recovery off, saying why, where this loop cannot be recovered."""
        engine = self.engine
        if self.batches.why_not is not None:
            engine.in_place_unavailable(self.batches.why_not)
        elif (why := accumulating()) is not None:
            engine.in_place_unavailable(why)
        elif self._ddp is not None and (why := cannot_rebind(self._ddp)) is not None:
            engine.in_place_unavailable(f"the DDP model cannot be rebuilt on a new group: {why}")

    def _build(self) -> Any:
        """The view of a generation: the user's DDP re-pointed at its group (`rebind`), except
        generation 0's own; the tracked model as it is otherwise (FSDP2: the engine rebinds
        its mesh)."""
        if self._ddp is not None:
            if self._reuse:
                self._reuse = False
            else:
                rebind(self._ddp)
            return self._ddp
        return self.engine.tracked.model
