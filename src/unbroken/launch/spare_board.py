"""Where agents offer their ready spares, and where the leader hands them out across nodes.

A node's agent promotes its own ready spare when one of its workers dies: no round trip.
When it has none, when a whole node is lost, or when a rank is drained, the leader takes a
ready spare from any node (a standby node is an agent whose every process is a spare) and
asks that node's agent to promote it into the slot. Keys, under `a/<attempt>/`:

    ready/<node>                 the wids of the node's ready spares, rewritten on change
    hosts/<node>                 {wid: slot} of the members the node's agent runs
    standbys, standby/<i>        standby nodes, in the order they joined the attempt
    promote/<node>/n, .../<i>    the leader's requests to that node: {"spare", "slot"}
"""

from __future__ import annotations

from typing import Any

from unbroken.launch.control_store import ControlStore


class SpareBoard:
    """One agent's side: offer ready spares, say what it hosts, read promotion requests."""

    def __init__(self, ctl: ControlStore, attempt: int, node: int) -> None:
        self.ctl = ctl
        self.prefix = f"a/{attempt}/"
        self.node = node
        self._offered: list[str] | None = None
        self._hosted: dict[str, int] | None = None
        self._requests_seen = 0

    def offer(self, ready: list[str]) -> None:
        if ready != self._offered:
            self.ctl.set_json(f"{self.prefix}ready/{self.node}", ready)
            self._offered = list(ready)

    def host(self, members: dict[str, int]) -> None:
        if members != self._hosted:
            self.ctl.set_json(f"{self.prefix}hosts/{self.node}", members)
            self._hosted = dict(members)

    def join_as_standby(self, instance: str) -> None:
        index = self.ctl.add(self.prefix + "standbys", 1) - 1
        self.ctl.set_json(f"{self.prefix}standby/{index}", {"node": self.node, "instance": instance})

    def requests(self) -> list[dict[str, Any]]:
        """Promotion requests for this node not yet returned."""
        count = self.ctl.add(f"{self.prefix}promote/{self.node}/n", 0)
        new = []
        while self._requests_seen < count:
            request = self.ctl.get_json(f"{self.prefix}promote/{self.node}/{self._requests_seen}")
            if request is None:
                break  # counted, not yet written: next tick
            new.append(request)
            self._requests_seen += 1
        return new


class SpareBroker:
    """The leader's side: which nodes exist, what they host, and whose spare fills a slot."""

    def __init__(self, ctl: ControlStore, attempt: int, nodes: list[int]) -> None:
        self.ctl = ctl
        self.prefix = f"a/{attempt}/"
        self.nodes = list(nodes)  # the attempt's planned nodes
        self.standbys: dict[int, str] = {}  # standby node -> its agent's instance
        self._standbys_seen = 0
        self.assigned: set[str] = set()  # spares already handed out

    def refresh(self) -> dict[int, str]:
        """Standby nodes that joined since the last look (one store read when none did)."""
        count = self.ctl.add(self.prefix + "standbys", 0)
        while self._standbys_seen < count:
            entry = self.ctl.get_json(f"{self.prefix}standby/{self._standbys_seen}")
            if entry is None:
                break
            self.standbys[int(entry["node"])] = entry["instance"]
            self._standbys_seen += 1
        return self.standbys

    def hosted(self, node: int) -> dict[str, int]:
        return self.ctl.get_json(f"{self.prefix}hosts/{node}") or {}

    def ready(self, avoid: set[int] = frozenset()) -> list[tuple[int, str]]:
        """(node, spare wid) of every ready spare not yet handed out, standby nodes first."""
        self.refresh()
        found = []
        for node in [*self.standbys, *self.nodes]:
            if node in avoid:
                continue
            for wid in self.ctl.get_json(f"{self.prefix}ready/{node}") or []:
                if wid not in self.assigned:
                    found.append((node, wid))
        return found

    def assign(self, node: int, spare: str, slot: int) -> None:
        """Ask `node`'s agent to promote `spare` into `slot`."""
        self.assigned.add(spare)
        index = self.ctl.add(f"{self.prefix}promote/{node}/n", 1) - 1
        self.ctl.set_json(f"{self.prefix}promote/{node}/{index}", {"spare": spare, "slot": slot})
