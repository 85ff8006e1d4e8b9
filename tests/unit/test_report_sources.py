"""Where `unbroken report` (and `simulate --from-run`) read a run's events from
(telemetry/report.py `event_sources`, `load_events`): a run dir, an event dir holding every
pod's copy (`--event-dir`: a deleted pod's file beside its recreated pod's), and a saved
pod log whose tagged lines carry the events (`--event-stdout`). Files only: events written
by the test."""

from __future__ import annotations

import json

import pytest

from unbroken.errors import UserError
from unbroken.telemetry import schema as ev
from unbroken.telemetry.event_copy import EVENT_TAG, copy_name
from unbroken.telemetry.report import event_sources, load_events


def record(body: ev.EventBody, t: float, **context) -> dict:
    return {"t": t, "event": body.EVENT, "v": 1, **context, **ev.encode(body)}


def agent_start(t: float, node: int) -> dict:
    return record(ev.AgentStart(run_id="job", pid=1, nnodes=2, nproc_per_node=1,
                                max_restarts=3, script="train.py", args=[], faults=[],
                                instance=f"a{node}-{t}"), t, source="agent", node=node)


def step(t: float, node: int, slot: int, n: int) -> dict:
    return record(ev.Step(step=n, duration=0.1), t, source="worker", node=node, slot=slot,
                  rank=slot, attempt=0)


def write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_an_event_dir_merges_every_pods_copy_a_deleted_pods_included(tmp_path):
    copies = tmp_path / "unbroken-events" / "job-1234"
    copies.mkdir(parents=True)
    write(copies / copy_name(0, "uid-a"), [agent_start(1.0, 0), step(2.0, 0, 0, 0),
                                          step(3.0, 0, 0, 1)])
    write(copies / copy_name(1, "uid-b"), [agent_start(1.1, 1), step(2.1, 1, 1, 0)])  # deleted
    write(copies / copy_name(1, "uid-c"), [agent_start(5.0, 1), step(6.0, 1, 1, 1)])  # recreated
    (copies / "notes.txt").write_text("not an event file")
    assert [p.name for p, _ in event_sources(copies)] == [
        "node0-uid-a.jsonl", "node1-uid-b.jsonl", "node1-uid-c.jsonl"]
    events = load_events([copies])
    assert [(e["event"], e["node"], e["t"]) for e in events] == [
        ("agent_start", 0, 1.0), ("agent_start", 1, 1.1), ("step", 0, 2.0), ("step", 1, 2.1),
        ("step", 0, 3.0), ("agent_start", 1, 5.0), ("step", 1, 6.0)]


def test_a_saved_pod_log_gives_its_tagged_lines_and_a_line_seen_twice_counts_once(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = [agent_start(1.0, 0), step(2.0, 0, 0, 0)]
    write(run_dir / "events.jsonl", events)
    log = tmp_path / "pod.log"
    log.write_text("[unbroken node 0] run job: events in /var/run/unbroken/run/events.jsonl\n"
                   "[default0]:step    0  loss 4.170\n"
                   + "".join(f"[pod/job-node-0-0-x/node] {EVENT_TAG}{json.dumps(e)}\n"
                             for e in [*events, step(3.0, 0, 0, 1)]))
    assert [e["t"] for e in load_events([log])] == [1.0, 2.0, 3.0]
    assert [e["t"] for e in load_events([run_dir, log])] == [1.0, 2.0, 3.0]


def test_a_source_with_no_events_is_one_line_naming_what_to_pass(tmp_path):
    with pytest.raises(UserError, match="the --event-dir, or a saved log") as err:
        event_sources(tmp_path / "nothing")
    assert "\n" not in str(err.value)
