"""A node's clock offset to the leader, bounded from the rendezvous's own messages.

The follower stamps `sent` (its clock) in its `NodeJoin`; the leader notes `seen` (its clock)
when it first reads that join, and `written` (its clock) just before it writes the plan; the
follower stamps `got` (its clock) once it has read the plan. With θ the leader's clock minus
the follower's, causality gives `written - got <= θ <= seen - sent`: no extra round trip.
"""

from __future__ import annotations


def estimate_offset(sent: float, seen: float, written: float,
                    got: float) -> tuple[float, float] | None:
    """(offset, error): the seconds to add to the follower's clock to get the leader's (the
    midpoint of the bounds) and half the bounds' width. None when the bounds cross (a clock
    jumped, or was stepped, between the join and the plan): no estimate."""
    lower, upper = written - got, seen - sent
    if lower > upper:
        return None
    return (lower + upper) / 2, (upper - lower) / 2
