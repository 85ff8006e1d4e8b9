"""Which state a new generation of a sharded job resumes from, and where each rank gets its
shard: a pure function of what every member holds.

Each member of the new generation needs one shard index (its slot's). It may hold that
shard live (its current state, at its committed step), in its own in-memory snapshot, or a
buddy's snapshot of another index; HSDP members of one index hold the same shard. The plan
picks the newest step at which every needed index is held by somebody, so that nothing rolls
back when a live replica exists (HSDP), and survivors roll back to the newest common
snapshot otherwise (FSDP with a buddy's copy). A member that does not hold its index at
that step receives it from one that does, senders taking turns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Holding:
    """One copy of one shard, held by `member` (a rank of the new generation)."""

    member: int
    shard: int
    step: int
    live: bool  # the member's current state; else an in-memory snapshot


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    live: bool  # the sender sends its current state; else its snapshot of that step


@dataclass(frozen=True)
class ShardPlan:
    step: int
    restore: frozenset[int]  # members that load their own snapshot of `step`
    transfers: tuple[Transfer, ...]
    rolled_back: bool  # some member's live state was newer than `step`


@dataclass(frozen=True)
class Unrecoverable:
    reason: str


def plan_shards(needs: list[int], holdings: list[Holding]) -> ShardPlan | Unrecoverable:
    """`needs[m]`: the shard index member m must hold; `holdings`: every copy anyone has."""
    by_step: dict[int, dict[int, list[Holding]]] = {}
    for h in holdings:
        by_step.setdefault(h.step, {}).setdefault(h.shard, []).append(h)
    wanted = set(needs)
    for step in sorted(by_step, reverse=True):
        held = by_step[step]
        if not wanted <= set(held):
            continue
        restore, transfers, sends = set(), [], dict.fromkeys(range(len(needs)), 0)
        for member, shard in enumerate(needs):
            copies = held[shard]
            own = [h for h in copies if h.member == member]
            if any(h.live for h in own):
                continue
            if own:
                restore.add(member)
                continue
            # Prefer a live sender (its state is in place), then the least busy.
            src = min(copies, key=lambda h: (not h.live, sends[h.member], h.member))
            sends[src.member] += 1
            transfers.append(Transfer(src=src.member, dst=member, live=src.live))
        newest_live = max((h.step for h in holdings if h.live), default=step)
        return ShardPlan(step=step, restore=frozenset(restore), transfers=tuple(transfers),
                         rolled_back=newest_live > step)
    return Unrecoverable(_why(needs, holdings))


def _why(needs: list[int], holdings: list[Holding]) -> str:
    if not holdings:
        return "no member holds any state or in-memory snapshot"
    held = {h.shard for h in holdings}
    lost = sorted(set(needs) - held)
    if lost:
        return (f"shard(s) {lost} have no copy left: their owner and every buddy or "
                "replica holding them are gone")
    steps = {}
    for h in holdings:
        steps.setdefault(h.shard, set()).add(h.step)
    detail = "; ".join(f"shard {s}: steps {sorted(steps[s])}" for s in sorted(set(needs)))
    return f"no step at which every shard is held ({detail})"
