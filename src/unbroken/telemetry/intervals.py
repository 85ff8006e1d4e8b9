"""Labelled intervals of one rank's time and the sweep that charges each instant to one
category (pure): the primitives of the goodput accounting (`goodput.py`, `watched_steps.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from unbroken.telemetry.categories import Category

# Higher wins where labels overlap. Point labels (what the events time exactly) outrank the
# windows that fill the time between them.
PRIORITY: dict[str, int] = {
    "restore": 100, "startup": 95, "rendezvous": 90, "stall": 85, "data": 80,
    "redone": 70, "straggler": 65, "step": 60, "between_steps": 55, "setup": 50,
    "flush": 45, "cut_short": 40, "shrunk": 35, "recovery": 30, "untracked": 20, "spawn": 10,
}
CATEGORY: dict[str, Category] = {
    "restore": Category.CHECKPOINT_RESTORE, "startup": Category.PROGRAM_STARTUP,
    "rendezvous": Category.INIT_RENDEZVOUS, "stall": Category.CHECKPOINT_SAVE,
    "data": Category.DATA_LOADING, "redone": Category.WASTED_PROGRESS,
    "straggler": Category.STRAGGLER, "step": Category.PRODUCTIVE_STEP,
    "between_steps": Category.PRODUCTIVE_STEP, "setup": Category.INIT_RENDEZVOUS,
    "flush": Category.CHECKPOINT_SAVE, "cut_short": Category.WASTED_PROGRESS,
    "recovery": Category.INFRASTRUCTURE_RECOVERY, "shrunk": Category.CAPACITY_LOST,
    "untracked": Category.UNTRACKED, "spawn": Category.PROGRAM_STARTUP,
}


@dataclass(frozen=True)
class Label:
    """A span of one slot's time that the events say was spent on `kind` (`PRIORITY`)."""

    start: float
    end: float
    kind: str


@dataclass(frozen=True)
class Segment:
    """A maximal span of one slot's time charged to one category."""

    slot: int
    start: float
    end: float
    category: Category



def sweep(labels: Iterable[Label], start: float, end: float, slot: int) -> list[Segment]:
    """Charge every instant of [start, end] to the highest-priority label covering it (idle
    where none does); consecutive spans of one category are merged."""
    bounded = sorted((max(lb.start, start), min(lb.end, end), lb.kind) for lb in labels
                     if lb.end > start and lb.start < end and lb.end > lb.start)
    cuts = sorted({start, end, *(b for s, e, _ in bounded for b in (s, e))})
    active: list[tuple[int, float, str]] = []  # (-priority, end, kind), lazily pruned
    out: list[Segment] = []
    i = 0
    for a, b in zip(cuts, cuts[1:], strict=False):
        while i < len(bounded) and bounded[i][0] <= a:
            s, e, kind = bounded[i]
            heapq.heappush(active, (-PRIORITY[kind], e, kind))
            i += 1
        while active and active[0][1] <= a:
            heapq.heappop(active)
        # A popped-late label (ended, but under a higher one) is pruned when it surfaces.
        category = CATEGORY[active[0][2]] if active else Category.IDLE
        if out and out[-1].category == category and out[-1].end == a:
            out[-1] = Segment(slot, out[-1].start, b, category)
        else:
            out.append(Segment(slot, a, b, category))
    return out
