"""Where a run's events are read from, and how they merge: run dirs, the nodes' copies in an
event dir (`--event-dir`), saved pod logs (`--event-stdout`); one line seen twice once, each
node's clock moved onto the leader's. `unbroken report`, `simulate --from-run` and the
summary read through here."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from unbroken.errors import UserError
from unbroken.telemetry import schema as ev
from unbroken.telemetry.event_copy import COPY_GLOB, EVENT_TAG
from unbroken.telemetry.events import EVENTS_FILE, parse_lines, read_events


def event_sources(source: str | Path) -> list[tuple[Path, list[dict[str, Any]]]]:
    """The event logs a report source holds, each as (its path, its records): a run dir
    (its `events.jsonl`, rotated files included), a dir of nodes' copies (`--event-dir`:
    every `node<K>-<ID>.jsonl`, a deleted pod's included), a copy's file, or a saved log
    (`kubectl logs`: the lines that carry `--event-stdout`'s tag, whatever precedes it)."""
    path = Path(source)
    if path.is_dir() and (path / EVENTS_FILE).is_file():
        return [(path, read_events(path / EVENTS_FILE))]
    if path.is_dir() and (copies := sorted(path.glob(COPY_GLOB))):
        return [(copy, _records(copy)) for copy in copies]
    if path.is_file():
        return [(path, _records(path))]
    raise UserError(f"no event log at {path}; pass the run directory `unbroken run` printed "
                    "(one per node if they do not share it), the --event-dir, or a saved log")


def _records(path: Path) -> list[dict[str, Any]]:
    """A copy's records, or a saved log's tagged ones (a file that is neither: none)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = list(fh)
    tagged = [line.split(EVENT_TAG, 1)[1] for line in lines if EVENT_TAG in line]
    return parse_lines(tagged if tagged else lines)


def load_events(run_dirs: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every event of a run, from one or more sources (`event_sources`: run dirs, one per
    node where nodes do not share a file system, event dirs, saved logs), merged in time
    order. A line found twice (a shared dir given twice, a run dir and its copy) counts
    once. Each node's timestamps are moved onto the leader's clock by the offset its agent
    measured at rendezvous (`clock_offset` events), when there is one: a log that one
    node's agent wrote to is moved whole by that node's offset (its leader may have written
    events about other nodes, on its own clock); a log shared by several nodes (one host,
    one clock) by each event's node."""
    per_dir: list[tuple[Any, list[dict[str, Any]]]] = []
    offsets: dict[Any, float] = {}
    seen: set[str] = set()
    for d in run_dirs:
        for _path, records in event_sources(d):
            found = []
            for e in records:
                line = json.dumps(e, sort_keys=True)
                if line not in seen:
                    seen.add(line)
                    found.append(e)
            typed = ev.decode_all(found)
            writers = {e.node for e in typed if isinstance(e, ev.AgentStart)}
            per_dir.append((writers.pop() if len(writers) == 1 else None, found))
            for e in typed:
                if isinstance(e, ev.ClockOffset):  # the latest one wins
                    offsets[e.node] = float(e.offset or 0.0)
    events = []
    for writer, found in per_dir:
        for e in found:
            shift = offsets.get(writer if writer is not None else e.get("node"), 0.0)
            if shift:
                e["t"] = e["t"] + shift
            events.append(e)
    events.sort(key=lambda e: e.get("t", 0.0))
    return events
