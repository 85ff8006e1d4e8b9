"""The run's event log: one JSON object per line, appended by agents and workers alike.

Every writer opens the file with O_APPEND and writes each line with a single `write`, so
lines from many processes interleave whole. The schema is in docs/events.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from unbroken.telemetry.event_names import Event

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events with a fixed set of context fields (source, node, rank, attempt)."""

    def __init__(self, path: str | os.PathLike[str] | None, **context: Any) -> None:
        self.path = Path(path) if path else None
        self.context = context
        self._fd: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: Event, **fields: Any) -> dict[str, Any]:
        record = {"t": round(time.time(), 6), "event": event, **self.context, **fields}
        if self._fd is not None:
            line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
            os.write(self._fd, line.encode())
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a log, in time order; a torn last line (a killed writer) is skipped."""
    events = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    events.sort(key=lambda e: e.get("t", 0.0))
    return events
