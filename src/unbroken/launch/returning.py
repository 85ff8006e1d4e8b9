"""A node's agent that starts while the job goes on without its node: typically a pod recreated
after a deletion, an eviction or a node loss, with the same node rank (its Job completion
index), a new address and an empty disk.

How it knows which it is, before it joins anything (`went_on_without`): the job has an attempt
open (`schema.CURRENT`), not ending, whose plan does not run this node with this agent; the
leader has put the node out of the job; and its ranks went on elsewhere (another node hosts a
slot it started the attempt with, `AttemptKeys.hosted`), or a later attempt runs the job's
full --nnodes without it. Out means:

- lost: its old agent's lease ran out (`LeaderRecord.nodes.out`);
- drained: its old agent handed every rank to spares on SIGTERM and said so
  (`AttemptKeys.node_released`);
- quarantined: its old agent's machine failed too often. The new agent is taken for a new
  machine (a recreated pod is placed again by the scheduler): as a standby node under a new
  id, it starts with no faults against it, and is quarantined again if it earns it.

Its ranks train elsewhere, in place (on a standby node or on spares), so the agent joins
as a standby node under an id of its own (`schema.standby_id`, claimed from
`schema.STANDBY_IDS`): it holds spares for the next loss. If the leader has not decided yet (the
old agent's lease has not yet run out), it waits for that decision, bounded. If the attempt
ends instead (no spare could take the ranks: a restart), or a later attempt runs fewer than
--nnodes nodes (the job shrank without it), it joins as the node it was: a restart admits it
(`node_set.admit`), and a leader whose world is short restarts to take it back in
(`Leader._node_back`). A fresh job (no attempt open: the first start, or a store that
restarted with its host) is joined as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from unbroken.control.channel import Channel
from unbroken.control.messages import AttemptPlan, NodeOut
from unbroken.control.schema import CURRENT, LEADER_RECORD, RESULT, AttemptKeys, node_out

_GONE = (NodeOut.LOST, NodeOut.DRAINED, NodeOut.QUARANTINED)
_TAKEOVER_WAIT = 5.0  # seconds, from the node seen out, for a spare to host its ranks


def _out(channel: Channel, node: int, attempt: int) -> NodeOut | None:
    record = channel.read(LEADER_RECORD)
    why = record.nodes.out.get(node) if record is not None else None
    if why is None and channel.read(node_out(node)) == NodeOut.QUARANTINED:
        return NodeOut.QUARANTINED
    if why is None and channel.read(AttemptKeys(attempt).node_released(node)):
        return NodeOut.DRAINED
    return why


def _taken_over(channel: Channel, attempt: int, plan: AttemptPlan, node: int) -> bool:
    """Does another node now host a slot this node started the attempt with (a spare of a
    standby node or of another node took it over, in place)?"""
    layout = plan.nodes[node]
    mine = set(range(layout.offset, layout.offset + layout.nproc))
    keys = AttemptKeys(attempt)
    standbys = [j.node for j in channel.entries(keys.standbys, 0) if j is not None]
    others = sorted((set(plan.nodes) | set(standbys)) - {node})
    hosted = channel.read_many([keys.hosted(k) for k in others])
    return any(mine & set((h or {}).values()) for h in hosted)


def went_on_without(channel: Channel, node: int, nnodes: int, wait: float,
                    sleep: Callable[[float], None]) -> bool:
    """True if the job runs on without `node` (this agent should join as a standby node);
    waits up to `wait` seconds for the leader to decide about an old agent still in the
    plan. False when the attempt ends meanwhile, or when it runs with fewer than `nnodes`
    nodes: this agent then joins as the node it was, and the leader restarts to take it
    back in (`Leader._node_back`)."""
    attempt = channel.read(CURRENT)
    if attempt is None:
        return False
    plan = channel.read(AttemptKeys(attempt).plan)
    if plan is None:
        return False
    deadline = time.monotonic() + wait
    while True:
        if (channel.read(CURRENT) != attempt or channel.read(AttemptKeys(attempt).fault)
                or channel.read(RESULT) is not None):
            return False  # the attempt (or the job) ends: joined as itself, it is told
        out = _out(channel, node, attempt) in _GONE
        if node not in plan.nodes:  # an attempt begun without it
            return out and len(plan.nodes) >= nnodes
        if out and _taken_over(channel, attempt, plan, node):
            return True
        if out:  # out, and its ranks not (yet) elsewhere: a promotion takes well under this
            deadline = min(deadline, time.monotonic() + _TAKEOVER_WAIT)
        if time.monotonic() > deadline:
            return False  # the job shrank in place without it: it waits as itself
        sleep(0.1)
