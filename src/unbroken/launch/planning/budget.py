"""The job's one restart budget: `--max-restarts` faults may be recovered from, in place or
by a full restart. It lives in the planner's state (`PlannerState.budget`), which the
leader keeps for the whole job."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RestartBudget:
    limit: int
    """`--max-restarts`: faults the job may recover from."""
    spent: int = 0
    """Faults paid for so far."""

    @property
    def left(self) -> int:
        return self.limit - self.spent

    def spend(self) -> RestartBudget | None:
        """The budget with one fault paid for; None when nothing is left (the fault ends
        the job)."""
        if self.spent >= self.limit:
            return None
        return replace(self, spent=self.spent + 1)
