"""The job's one restart budget: `--max-restarts` faults may be recovered from, in place or
by a full restart. The leader owns it (inside the planner's state while an attempt runs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RestartBudget:
    limit: int
    """`--max-restarts`: faults the job may recover from."""
    spent: int = 0

    @property
    def left(self) -> int:
        return self.limit - self.spent

    def spend(self) -> bool:
        """Pay for one fault; False when nothing is left (the fault ends the job)."""
        if self.spent >= self.limit:
            return False
        self.spent += 1
        return True
