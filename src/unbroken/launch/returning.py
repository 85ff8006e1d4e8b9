"""A node's agent that starts while the job goes on without its node: typically a pod recreated
after a deletion, an eviction or a node loss, with the same node rank (its Job completion
index), a new address and an empty disk.

How it knows which it is, before it joins anything (`went_on_without`): the job has an attempt
open (`schema.CURRENT`) whose plan does not run this node with this agent, and the leader has
put the node out of the job:

- lost: its old agent's lease ran out (`LeaderRecord.nodes.out`);
- drained: its old agent handed every rank to spares on SIGTERM and said so
  (`AttemptKeys.node_released`);
- quarantined: its old agent's machine failed too often. The new agent is taken for a new
  machine (a recreated pod is placed again by the scheduler): as a standby node under a new
  id, it starts with no faults against it, and is quarantined again if it earns it.

Its ranks then train elsewhere, in place (on a standby node or on spares), and the agent joins
as a standby node under an id of its own (`schema.standby_id`, claimed from
`schema.STANDBY_IDS`): it holds spares for the next loss. If the leader has not decided yet (the
old agent's lease has not yet run out), it waits for that decision, bounded. A restart opened
meanwhile (a new attempt) admits it as the node it was (`node_set.admit`), and a fresh job (no
attempt open: the first start, or a store that restarted with its host) is joined as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from unbroken.control.channel import Channel
from unbroken.control.messages import NodeOut
from unbroken.control.schema import CURRENT, LEADER_RECORD, AttemptKeys, node_out

_GONE = (NodeOut.LOST, NodeOut.DRAINED, NodeOut.QUARANTINED)


def _out(channel: Channel, node: int, attempt: int) -> NodeOut | None:
    record = channel.read(LEADER_RECORD)
    why = record.nodes.out.get(node) if record is not None else None
    if why is None and channel.read(node_out(node)) == NodeOut.QUARANTINED:
        return NodeOut.QUARANTINED
    if why is None and channel.read(AttemptKeys(attempt).node_released(node)):
        return NodeOut.DRAINED
    return why


def went_on_without(channel: Channel, node: int, wait: float,
                    sleep: Callable[[float], None]) -> bool:
    """True if the job runs on without `node` (this agent should join as a standby node);
    waits up to `wait` seconds for the leader to decide about an old agent still in the plan."""
    attempt = channel.read(CURRENT)
    if attempt is None:
        return False
    plan = channel.read(AttemptKeys(attempt).plan)
    if plan is None:
        return False
    deadline = time.monotonic() + wait
    while True:
        why = _out(channel, node, attempt)
        if why in _GONE:
            return True
        if node not in plan.nodes or channel.read(CURRENT) != attempt:
            return False  # not running without it: it joins the next attempt as itself
        if time.monotonic() > deadline:
            return False
        sleep(0.1)
