"""Where an agent offers its ready spares and says which members it runs.

A node's agent promotes its own ready spare when one of its workers dies: no round trip.
When it has none, when a whole node is lost, or when a rank is drained, the leader's planner
takes a ready spare from any node (a standby node is an agent whose every process is a
spare) and orders that node's agent to promote it (`NodeOrder`, in `attempt`). The keys
(`ready/<node>`, `hosts/<node>`, `standby` queue) are declared in `control.schema`.
"""

from __future__ import annotations

from unbroken.control.channel import Channel
from unbroken.control.messages import StandbyJoin
from unbroken.control.schema import AttemptKeys


class SpareBoard:
    """One agent's side, for one attempt: rewrites its keys only when they change."""

    def __init__(self, channel: Channel, keys: AttemptKeys, node: int) -> None:
        self.channel = channel
        self.keys = keys
        self.node = node
        self._offered: list[str] = []  # an absent key offers nothing: no write needed
        self._hosted: dict[str, int] | None = None

    def news(self, ready: list[str]) -> bool:
        """Whether `ready` differs from what is offered: the next look should offer it."""
        return ready != self._offered

    def offer(self, ready: list[str]) -> bool:
        """Publish the wids of this node's ready spares; whether the offer changed (and was
        written)."""
        if not self.news(ready):
            return False
        self.channel.write(self.keys.ready_spares(self.node), ready)
        self._offered = list(ready)
        return True

    def host(self, members: dict[str, int]) -> None:
        if members != self._hosted:
            self.channel.write(self.keys.hosted(self.node), members)
            self._hosted = dict(members)

    def join_as_standby(self, instance: str) -> None:
        self.channel.append(self.keys.standbys, StandbyJoin(node=self.node, instance=instance))
