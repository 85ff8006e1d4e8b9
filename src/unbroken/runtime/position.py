"""Where one worker stands in the job: one record, replaced whole.

The engine (`runtime/engine.py`) holds the current `Position` and replaces it in one place
(`Engine._move`): after each committed step, when a spare warms up in its own world, and
when a switch into a new generation completes. Everything else reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Position:
    """One worker's place in the job at a step boundary."""

    rank: int
    """This worker's rank in the current generation (a spare's is 0 until promoted)."""
    world_size: int
    """The number of workers in the current generation."""
    step: int
    """The next step to run; equals the number of committed steps."""
    gen: int = 0
    """The generation: 0 as launched, one more for each switch in place."""
    holds_state: bool = True
    """Whether this worker's tracked state is whole at `step` (False while a joiner waits
    for a peer's, or while an update or a receipt overwrites it)."""

    def moved(self, **changes: int | bool) -> Position:
        """A copy with `changes` applied (`dataclasses.replace`)."""
        return replace(self, **changes)
