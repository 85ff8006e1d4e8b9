"""The job's node set, as pure functions of a `NodeSet` value: which nodes a full restart
waits for, which are out of the job and why, and when a node that keeps failing (a lemon)
is quarantined.

- A node declared lost, drained or quarantined is out: no later attempt waits for it.
- A standby node that took over an out node's ranks in place takes that node's place in the
  rank order, and keeps it across later full restarts.
- A node with `QuarantineRule.after` strikes (faults) within `window` seconds is quarantined: its ranks
  go to a standby node or spares, and it is never used again in this job.
- A lost node whose agent comes back (a new instance) is admitted again at the next attempt;
  a quarantined one is not.

The planner's node lifecycle (`node_life.py`) and the leader apply these and persists the value in `LeaderRecord`, so that a
successor continues with the same set.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from unbroken.control.messages import NodeOut, NodeSet


@dataclass(frozen=True)
class QuarantineRule:
    after: int = 3
    """Strikes (faults counted against one node) within `window` that quarantine it (0: never)."""
    window: float = 3600.0
    """Seconds."""


def initial(nnodes: int) -> NodeSet:
    return NodeSet(order=list(range(nnodes)))


def strike(ns: NodeSet, node: int, t: float, rule: QuarantineRule) -> tuple[NodeSet, bool]:
    """Count a strike (a fault) against `node` at wall time `t`; True if this strike
    quarantines it."""
    ns = copy.deepcopy(ns)
    recent = [x for x in ns.faults.get(node, []) if t - x <= rule.window] + [t]
    ns.faults[node] = recent
    if rule.after and len(recent) >= rule.after and ns.out.get(node) != NodeOut.QUARANTINED:
        ns.out[node] = NodeOut.QUARANTINED
        return ns, True
    return ns, False


def nobody_left(ns: NodeSet) -> bool:
    """Every node of the order is out (lost, drained or quarantined): a static job has no
    node left to wait for, and would wait for nothing forever."""
    return all(k in ns.out for k in ns.order)


def mark_out(ns: NodeSet, node: int, why: NodeOut) -> NodeSet:
    """`node` is out (a quarantine is never downgraded to lost or drained)."""
    ns = copy.deepcopy(ns)
    if ns.out.get(node) != NodeOut.QUARANTINED:
        ns.out[node] = why
    return ns


def after_attempt(ns: NodeSet, layout: dict[int, list[int]],
                  hosted: dict[int, set[int]]) -> tuple[NodeSet, dict[int, int]]:
    """The order of the next attempt: each out node's place goes to the node (not already
    in the order) that hosts most of its slots now, typically a standby node; an out node
    that nobody took over leaves the order (the world shrinks by its ranks).

    `layout`: the slots each node started the attempt with; `hosted`: the slots each node's
    workers hold now. Returns the new set and the takeovers: {out node: its heir}."""
    ns = copy.deepcopy(ns)
    order: list[int] = []
    heirs_of: dict[int, int] = {}
    for node in ns.order:
        if node not in ns.out:
            order.append(node)
            continue
        mine = set(layout.get(node, []))
        heirs = [(len(mine & slots), k) for k, slots in hosted.items()
                 if k not in ns.order and k not in ns.out and k not in order and mine & slots]
        if heirs:
            heirs_of[node] = max(heirs)[1]
            order.append(heirs_of[node])
    ns.order = order
    return ns, heirs_of


def admit(ns: NodeSet, node: int) -> tuple[NodeSet, bool]:
    """A node's agent joined an attempt: it is one of the job's nodes unless quarantined.
    A node that was lost or drained and came back (a new agent) is back in the order, at
    the end."""
    if ns.out.get(node) == NodeOut.QUARANTINED:
        return ns, False
    ns = copy.deepcopy(ns)
    ns.out.pop(node, None)
    if node not in ns.order:
        ns.order.append(node)
    return ns, True


@dataclass(frozen=True)
class Gathering:
    """Elastic rendezvous (`--nnodes MIN:MAX`): who is waited for, and how many may train."""

    least: int
    """MIN: the attempt does not start with fewer nodes."""
    cap: int
    """The most nodes that train: MAX (torchrun's meaning), or MIN (`--extra-nodes standby`)."""
    last_call: float
    """Seconds to wait for more once `least` joined, on the first attempt only."""


def gather(ns: NodeSet, joined: list[int], leader: int, rule: Gathering, attempt: int,
           since_enough: float | None, expected: tuple[int, ...] = ()) -> tuple[NodeSet | None, bool]:
    """Decide an elastic attempt's nodes from the agents that joined it (pure).

    The nodes of the order that are still in are waited for; with them, at least `least`
    in all. The first attempt then waits `last_call` seconds for more (torchrun's last call),
    unless the cap is reached; a restart waits so only for `expected` nodes (the last
    attempt's standing-by nodes, on their way to rejoin). Returns (the set with its new order:
    the leader first, then the order's nodes, then newcomers by rank, up to the cap; or None:
    keep waiting) and whether `least` is reached (the caller starts the last-call clock)."""
    quarantined = {k for k, why in ns.out.items() if why == NodeOut.QUARANTINED}
    present = [k for k in sorted(set(joined)) if k not in quarantined]
    required = [k for k in ns.order if k not in ns.out]
    enough = all(k in present for k in required) and len(present) >= rule.least
    if not enough:
        return None, False
    more = attempt == 0 or any(k not in present for k in expected)
    if more and len(present) < rule.cap and (since_enough is None or since_enough < rule.last_call):
        return None, True
    order = [leader] if leader in present else []
    order += [k for k in required if k not in order]
    order += [k for k in present if k not in order]
    ns = copy.deepcopy(ns)
    ns.order = order[:rule.cap]
    return ns, True
