"""The leader's dealings with the other agents of an attempt (`Leader`'s followers): who they
are, how long each one's liveness lease has been silent, and the quarantined ones sent off.

It keeps no node state: each call is handed the attempt's plan and the `Nodes` record of the
leader's one `PlannerState` (`node_life`), and what it learns goes back through the planner.
It remembers only what it already told a quarantined node this attempt (`reset` between
attempts), and the lease watch's last sightings.
"""

from __future__ import annotations

import time

from unbroken.control.channel import Channel
from unbroken.control.lease import LeaseWatch
from unbroken.control.messages import AttemptPlan, DrainKind, DrainRequest, NodeOrder, OrderKind
from unbroken.control.schema import AttemptKeys, agent_lease
from unbroken.launch.config import LaunchConfig
from unbroken.launch.planning.node_life import Nodes


class Followers:
    """The other agents of the leader's attempt, seen from the leader (see the module)."""

    def __init__(self, cfg: LaunchConfig, channel: Channel) -> None:
        self.cfg = cfg
        self.channel = channel
        # Read at most 20 times per --node-timeout: on the TCPStore each read is N keys.
        self.leases = LeaseWatch(channel.backend, pause_limit=cfg.node_timeout / 2,
                                 confirm_after=cfg.node_timeout / 2, every=cfg.node_timeout / 20)
        self._leaving: set[int] = set()  # quarantined nodes ordered to leave
        self._draining: set[int] = set()  # quarantined nodes whose ranks a drain moves

    def reset(self) -> None:
        """A new attempt: lease sightings and the quarantined nodes' orders start afresh."""
        self.leases.reset()
        self._leaving.clear()
        self._draining.clear()

    def of(self, plan: AttemptPlan, nodes: Nodes) -> dict[int, str]:
        """Every other agent of the attempt (planned nodes and standby nodes): its instance."""
        others = {k: n.instance for k, n in plan.nodes.items() if k != self.cfg.node_rank}
        others.update(nodes.standby)
        return others

    def silences(self, attempt: int, plan: AttemptPlan,
                 nodes: Nodes) -> tuple[dict[int, float], list[int]]:
        """How long each watched agent's lease has not moved, and which of those silent
        past --node-timeout said they left on purpose (drained)."""
        watched = {k: i for k, i in self.of(plan, nodes).items() if not nodes.gone(k)}
        silent = self.leases.silent_many([agent_lease(k, i) for k, i in watched.items()],
                                         time.monotonic())
        silences = dict(zip(watched, silent, strict=True))
        released = [k for k, t in silences.items() if t > self.cfg.node_timeout
                    and self.channel.read(AttemptKeys(attempt).node_released(k))]
        return silences, released

    def send_off(self, attempt: int, plan: AttemptPlan, nodes: Nodes) -> None:
        """Each quarantined node of the attempt, once the planner is idle: its ranks are
        drained onto ready spares (a standby node's first; if there are too few, the drain
        is refused and the node keeps them until the next full restart, which leaves it out);
        once it holds no rank, it is told to leave."""
        keys = AttemptKeys(attempt)
        for k in nodes.quarantined:
            if k in self._leaving or k == self.cfg.node_rank \
                    or k in nodes.lost or k not in self.of(plan, nodes):
                continue
            if self.channel.read(keys.hosted(k)):
                if k not in self._draining:
                    self._draining.add(k)
                    self.channel.append(keys.drains, DrainRequest(kind=DrainKind.NODE, target=k))
                continue
            self._leaving.add(k)
            self.channel.append(keys.orders(k), NodeOrder(kind=OrderKind.LEAVE, slot=-1))
