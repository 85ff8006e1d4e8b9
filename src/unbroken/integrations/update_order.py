"""The order of the calls in one update of a framework's training loop, as an adapter relies
on it, checked on the first updates of every job. Pure: the adapter reports each call
(`UpdateOrder.saw`), and hears back the first invariant broken, once.

The Trainer's update, as `integrations/hf.py` relies on it (docs/integrations.md):

1. `count`: the item count of the update's micro-batches (`_get_num_items_in_batch`), first,
   over all of them (1 to `accumulation` batches): the adapter's step boundary;
2. `micro`: one `training_step` per batch counted, no more;
3. `clip`: the gradient clipping, once, after the last micro-batch (where the Trainer clips
   through a method of its own and clipping is on);
4. `pre_optimizer`: `on_pre_optimizer_step`, after every micro-batch and the clipping;
5. `optimizer`: `on_optimizer_step`, after it (one optimizer step);
6. the scheduler: where the Trainer steps one per update (`schedules`), it steps between
   the optimizer step and `on_step_end`, never during the micro-batches (the committed
   state, taken at `on_step_end`, holds its step; a skipped update's is set back there);
7. `step_end`: `on_step_end`, after it, with `global_step` one past the last update's.

The scheduler is seen by its count of steps (`last_epoch`), read at the item count, the
optimizer step and `on_step_end`, never by wrapping it (its state dict is the job's state).

An adapter whose framework breaks one of these turns in-place recovery off before any fault
(a fault then restarts every worker, as under torchrun) and says which, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Call(StrEnum):
    """A call of the loop the adapter sees."""

    COUNT = "count"
    MICRO = "micro"
    CLIP = "clip"
    PRE_OPTIMIZER = "pre_optimizer"
    OPTIMIZER = "optimizer"
    STEP_END = "step_end"


_AFTER = {  # each call, and the one that must come just before it within an update
    Call.CLIP: Call.MICRO,
    Call.OPTIMIZER: Call.PRE_OPTIMIZER,
    Call.STEP_END: Call.OPTIMIZER,
}


@dataclass
class UpdateOrder:
    """The invariants above, over the first `updates` updates."""

    accumulation: int
    """The Trainer's `gradient_accumulation_steps`: the most micro-batches in one update."""
    clips: bool
    """The Trainer clips through a method the adapter sees (`clip` is expected)."""
    schedules: bool = False
    """The Trainer steps a scheduler once per update (not `ReduceLROnPlateau`, which steps
    on a metric): its count (`scheduler_at`) is checked."""
    updates: int = 2
    """How many updates are checked; then `saw` checks nothing."""
    checked: int = 0
    broken: str | None = None
    """The first invariant broken (None: none yet)."""
    _calls: list[Call] = field(default_factory=list)
    _batches: int = 0
    _last_step: int | None = None
    _scheduled: dict[Call, int] = field(default_factory=dict)

    @property
    def checking(self) -> bool:
        return self.broken is None and self.checked < self.updates

    def saw(self, call: Call, batches: int = 0, global_step: int = 0,
            scheduler_at: int = 0) -> str | None:
        """`call` happened (`batches`: the count's, `global_step`: at `step_end`,
        `scheduler_at`: the scheduler's steps so far, at the count, the optimizer step and
        `step_end`). The invariant it breaks, the first time one is broken; None otherwise."""
        if not self.checking:
            return None
        wrong = self._wrong(call, batches, global_step)
        if wrong is None and self.schedules:
            wrong = self._scheduler(call, scheduler_at)
        self._calls.append(call)
        if wrong is not None:
            self.broken = f"update {self.checked + 1}: {wrong}"
            return self.broken
        if call is Call.STEP_END:
            self.checked += 1
            self._last_step, self._calls = global_step, []
        return None

    def _scheduler(self, call: Call, at: int) -> str | None:
        seen = self._scheduled
        if call is Call.COUNT:
            seen.clear()
            seen[call] = at
        elif call is Call.OPTIMIZER:
            seen[call] = at
            if at != seen.get(Call.COUNT, at):
                return "the scheduler stepped before the optimizer step"
        elif call is Call.STEP_END and at <= seen.get(Call.OPTIMIZER, at - 1):
            return "the scheduler did not step between the optimizer step and on_step_end"
        return None

    def _wrong(self, call: Call, batches: int, global_step: int) -> str | None:
        calls, last = self._calls, (self._calls[-1] if self._calls else None)
        micro = calls.count(Call.MICRO)
        if call is Call.COUNT:
            if calls:
                return f"the item count came after {last} within the update"
            if not 1 <= batches <= self.accumulation:
                return (f"the item count was taken over {batches} micro-batch(es), not 1 to "
                        f"{self.accumulation}")
            self._batches = batches
            return None
        if not calls:
            return f"{call} came before the update's item count"
        if call in calls and call is not Call.MICRO:
            return f"{call} came twice in one update"
        if call is Call.MICRO and (micro >= self._batches or last is not Call.MICRO
                                   and last is not Call.COUNT):
            return f"a training_step came after {last}, or past the {self._batches} counted"
        if call is Call.PRE_OPTIMIZER:
            if micro != self._batches:
                return f"on_pre_optimizer_step came after {micro} of {self._batches} micro-batches"
            if last is not (Call.CLIP if self.clips else Call.MICRO):
                return f"on_pre_optimizer_step came after {last}, not after the clipping"
        if (before := _AFTER.get(call)) is not None and last is not before:
            return f"{call} came after {last}, not after {before}"
        if call is Call.CLIP and micro != self._batches:
            return f"the clipping came after {micro} of {self._batches} micro-batches"
        if call is Call.STEP_END and self._last_step is not None \
                and global_step != self._last_step + 1:
            return f"global_step went from {self._last_step} to {global_step} in one update"
        return None


def steps_per_update(scheduler: Any) -> bool:
    """The Trainer steps `scheduler` once per update: not a `ReduceLROnPlateau` (which steps
    on a metric), and not none at all. Accelerate's wrapper is seen through."""
    inner = getattr(scheduler, "scheduler", scheduler)
    return inner is not None and type(inner).__name__ != "ReduceLROnPlateau" \
        and isinstance(getattr(inner, "last_epoch", None), int)


def scheduler_steps(scheduler: Any) -> int:
    """The scheduler's count of steps (`last_epoch`; -1 without one)."""
    return getattr(getattr(scheduler, "scheduler", scheduler), "last_epoch", -1)
