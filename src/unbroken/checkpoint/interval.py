"""When to checkpoint: every N steps, every T seconds, or Young/Daly from measured cost.

Every rank must start a save at the same step (a save is collective), so time-based
intervals are turned into a number of steps, and the ranks agree on it (the largest
proposal wins) each time they agree to save. Young (1974) and Daly (2006): with checkpoint
cost C and mean time between failures M, the interval that loses the least work is about
sqrt(2CM); Daly's higher-order form is used. With async checkpoints C is the loop's stall,
so the interval is short; it never goes below the time one save takes to persist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.errors import UserError

# Before anything is measured, the first time-based checkpoint comes after this many steps.
FIRST_STEPS = 10


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's optimum compute time between checkpoints, in seconds (cost, mtbf in seconds)."""
    if cost <= 0:
        return 0.0
    if cost >= 2 * mtbf:
        return mtbf
    r = cost / (2 * mtbf)
    return math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(r) / 3 + r / 9) - cost


@dataclass
class Schedule:
    every_steps: int | None = None
    every_seconds: float | None = None
    mtbf_hours: float | None = None

    def __post_init__(self) -> None:
        given = [x for x in (self.every_steps, self.every_seconds, self.mtbf_hours) if x is not None]
        if len(given) > 1:
            raise UserError("give one of checkpoint_every, checkpoint_every_seconds and "
                            "checkpoint_mtbf_hours, not several")
        if self.every_steps is not None and self.every_steps < 1:
            raise UserError(f"checkpoint_every must be at least 1, got {self.every_steps}")
        for name, value in (("checkpoint_every_seconds", self.every_seconds),
                            ("checkpoint_mtbf_hours", self.mtbf_hours)):
            if value is not None and not value > 0:
                raise UserError(f"{name} must be > 0, got {value}")
        self.interval = self.every_steps or FIRST_STEPS  # steps between saves, agreed
        self.reason = ""
        self.reset(0)

    @property
    def enabled(self) -> bool:
        return any(x is not None for x in (self.every_steps, self.every_seconds, self.mtbf_hours))

    def due(self, step: int) -> bool:
        return self.enabled and step >= self.next_due

    def propose(self, step_time: float | None, cost: float | None, persist: float | None) -> int:
        """This rank's wish for the number of steps until the next save, and why."""
        if (self.every_seconds is None and self.mtbf_hours is None) or not step_time:
            self.reason = f"every {self.interval} steps"
            return self.interval
        if self.every_seconds is not None:
            seconds = self.every_seconds
            self.reason = f"every {seconds:g} s"
        else:
            mtbf = self.mtbf_hours * 3600
            c = cost or 0.0
            seconds = max(daly_interval(c, mtbf), persist or 0.0)
            self.reason = (f"Young/Daly: cost {c * 1e3:.1f} ms per checkpoint, "
                           f"MTBF {self.mtbf_hours:g} h, persist {persist or 0:.2f} s")
        return max(1, math.ceil(seconds / step_time))

    def reset(self, step: int, interval: int | None = None) -> None:
        """The next save after `step`: at the next multiple of N steps, or `interval` steps on."""
        if interval is not None:
            self.interval = interval
        if self.every_steps is not None:
            self.next_due = (step // self.every_steps + 1) * self.every_steps
        else:
            self.next_due = step + self.interval

    def deferred(self, step: int, retries: int) -> None:
        """The previous save is still being written: retry after 1, 2, 4, ... steps."""
        self.next_due = step + min(2 ** (retries - 1), max(1, self.interval))
