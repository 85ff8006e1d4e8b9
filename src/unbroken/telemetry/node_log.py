"""One node's events, each once: what its own agent emits (handed over in process, by the
event log's observers) and what its workers append to the log (tailed, `node` this one,
`source` not `agent`).

Why not the log alone: several agents may append to one shared log, and an agent's event
may name another node (the leader's `fault` for a lost node), so the log cannot tell which
agent wrote a line. Why not the observer alone: workers are other processes. The node's
metrics (`node_export`) and its copy of the events (`event_copy`) each read one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.telemetry.live import EventTail


class NodeLog:
    """`own(record)`: an event the agent emitted (any thread). `read()`: what is new, as
    (is it the agent's own, record), the agent's first. `node()`: the node's rank now (None:
    not known yet; nothing is read then)."""

    def __init__(self, events_path: Path, node: Callable[[], int | None]) -> None:
        self._tail = EventTail(events_path)
        self._own: deque[dict[str, Any]] = deque()
        self.node = node

    def own(self, record: dict[str, Any]) -> None:
        self._own.append(record)

    def read(self) -> list[tuple[bool, dict[str, Any]]]:
        node = self.node()
        if node is None:
            return []
        out = []
        while self._own:
            out.append((True, self._own.popleft()))
        for record in self._tail.read():
            if record.get("source") != "agent" and record.get("node") == node:
                out.append((False, record))
        return out

    def close(self) -> None:
        self._tail.close()
