"""The planner's refills of lost slots, as pure functions of its state: when a replacement is
ordered, whether a recovery may shrink the world or must wait for its lost ranks to be
refilled, and what is said while it waits.

A lost slot is refilled by a ready spare (promoted at once) or by a replacement its node
starts (`order`). Whether the survivors go on without it is the job's `--on-fault` policy,
except where the world size cannot change (`policy`): sharded state (it would need
resharding), or a framework that caches the world size (the Trainer's and Accelerate's
process count and sampler, Lightning's): such a job always waits.
"""

from __future__ import annotations

from collections.abc import Iterable

from unbroken.control.messages import Departure, NodeOrder, OrderKind
from unbroken.launch.planning.planner_commands import Command, Order, Say
from unbroken.launch.planning.planner_state import (
    Phase,
    PlannerConfig,
    PlannerState,
    Policy,
    Recovery,
)


def order(s: PlannerState, config: PlannerConfig, now: float) -> list[Command]:
    """Order replacements: at once under `wait` or in a fixed world; under `shrink` once the
    survivors run a newer generation (a start-up beside their switch would slow it), or
    after a delay. Mutates `s.spares` (ordered refills are awaited from now)."""
    out: list[Command] = []
    for refill in list(s.spares.refills):
        switched = s.phase == Phase.RUNNING and s.gen > refill.broke_gen
        if not (config.policy == Policy.WAIT or s.fixed_world or switched
                or now - refill.since > config.replacement_delay):
            continue
        s.spares.refills.remove(refill)
        s.spares.awaited[refill.slot] = now
        out.append(Order(refill.node, NodeOrder(OrderKind.REPLACE, slot=refill.slot)))
    return out


def hopeless(s: PlannerState, slots: set[int]) -> list[int]:
    """Those of `slots` that nothing is coming to refill: no spare promised, no replacement
    ordered or to be ordered (e.g. a standby node's rank: it starts no fresh worker)."""
    coming = set(s.spares.promised) | set(s.spares.awaited) | {r.slot for r in s.spares.refills}
    return sorted(slots - coming)


def policy(s: PlannerState, left: Iterable[Departure],
           config: PlannerConfig) -> tuple[Policy, str | None]:
    """The recovery's policy given the survivors' departures, and what fixed the world size
    (None: nothing did). A framework's fix is kept for the attempt (`s.fixed_world`): the
    next fault's refill is then ordered at once, before the departures come."""
    left = list(left)
    s.fixed_world = s.fixed_world or next((r.fixed_world for r in left if r.fixed_world), None)
    fixed = s.fixed_world or ("sharded state" if any(r.sharded for r in left) else None)
    return (Policy.WAIT if fixed else config.policy), fixed


def waiting(rec: Recovery, fixed: str | None, slots: Iterable[int],
            config: PlannerConfig) -> list[Command]:
    """One line, once per recovery, where a fixed world waits though `--on-fault` would not."""
    if fixed is None or rec.said_wait or config.policy == Policy.WAIT:
        return []
    rec.said_wait = True
    return [Say(f"rank(s) {sorted(slots)}: waiting up to {config.join_timeout:g}s for a spare "
                f"or a replacement, since {fixed} cannot change its world size")]
