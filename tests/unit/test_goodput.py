"""Goodput accounting (`telemetry.goodput`): the sweep's rules on hand-made events, no
processes. (A real run with a straggler and a crash: tests/integration/test_goodput.py.)
"""

from __future__ import annotations

import json
import math

import pytest

from unbroken.telemetry.categories import Category
from unbroken.telemetry.goodput import account
from unbroken.telemetry.intervals import Label, sweep
from unbroken.telemetry.report import load_events

C = Category


# ---------------------------------------------------------------- the rules, no processes
def test_the_highest_priority_label_wins_and_uncovered_time_is_idle():
    segs = sweep([Label(1, 5, "step"), Label(2, 3, "stall"), Label(4, 8, "recovery")], 0, 10, 0)
    got = [(s.start, s.end, s.category) for s in segs]
    assert got == [(0, 1, C.IDLE), (1, 2, C.PRODUCTIVE_STEP), (2, 3, C.CHECKPOINT_SAVE),
                   (3, 5, C.PRODUCTIVE_STEP), (5, 8, C.INFRASTRUCTURE_RECOVERY), (8, 10, C.IDLE)]


def test_labels_outside_the_accounted_span_are_clipped():
    segs = sweep([Label(-5, 2, "step"), Label(9, 20, "recovery")], 0, 10, 3)
    assert [(s.start, s.end, s.category) for s in segs] == [
        (0, 2, C.PRODUCTIVE_STEP), (2, 9, C.IDLE), (9, 10, C.INFRASTRUCTURE_RECOVERY)]
    assert all(s.slot == 3 for s in segs)


def _ev(t, event, **kw):
    return {"t": t, "event": event, **kw}


def _w(t, event, slot, **kw):
    return _ev(t, event, source="worker", slot=slot, rank=slot, node=0, **kw)


def _restarted_run():
    """Two ranks: start, steps 0-3 (a 3 s straggler at step 1, a checkpoint after step 1),
    a crash at t=10 during step 4, a restart that loads the checkpoint and redoes 2-3."""
    ev = [_ev(0.0, "agent_start", source="agent", node=0),
          _ev(0.1, "workers_started", source="agent", node=0, attempt=0, pids={"0": 1, "1": 2})]
    for slot in (0, 1):
        ev.append(_w(2.0, "worker_start", slot, attempt=0, world_size=2, startup=1.5,
                     process_group=0.5))
        ends = [3.0, 6.5, 7.0, 7.5]  # step 1 is the straggler: 3.5 s
        durs = [0.5, 3.45, 0.45, 0.45]
        for step, (end, d) in enumerate(zip(ends, durs, strict=True)):
            ev.append(_w(end, "step", slot, attempt=0, gen=0, step=step, duration=d, loss=1.0))
        ev.append(_w(6.9, "checkpoint_saved", slot, attempt=0, step=2, stall=0.02, durable=0.3))
    ev.append(_ev(10.0, "fault", source="agent", node=0, kind="crash", rank=1, slot=1, pid=2,
                  attempt=0, in_place=False, step=4))
    ev.append(_ev(10.0, "fault", source="agent", node=0, kind="crash", rank=1, slot=1, pid=2,
                  attempt=0, in_place=False, step=4, detail="charged to a restart"))
    ev.append(_ev(10.2, "restart", source="agent", node=0, attempt=1))
    ev.append(_ev(10.3, "workers_started", source="agent", node=0, attempt=1,
                  pids={"0": 3, "1": 4}))
    for slot in (0, 1):
        ev.append(_w(12.0, "worker_start", slot, attempt=1, world_size=2, startup=1.0,
                     process_group=0.2))
        ev.append(_w(12.5, "checkpoint_loaded", slot, attempt=1, step=2, duration=0.4))
        for step, end in ((2, 13.5), (3, 14.0), (4, 14.5)):
            ev.append(_w(end, "step", slot, attempt=1, gen=0, step=step, duration=0.45))
        ev.append(_w(14.6, "training_done", slot, attempt=1, step=5))
    ev.append(_ev(15.0, "agent_exit", source="agent", node=0, code=0))
    return sorted(ev, key=lambda e: e["t"])


def test_every_rank_sums_to_the_wall_and_each_rule_charges_its_category():
    r = account(_restarted_run())
    assert r["wall_s"] == 15.0 and r["world_size"] == 2
    for rank in r["ranks"]:
        assert math.isclose(sum(rank["seconds"].values()), 15.0, abs_tol=1e-6)
    s = r["seconds"]
    assert math.isclose(s[C.STRAGGLER], 3.45 - 0.45, abs_tol=1e-6)  # beyond the median step
    # Steps 2-3 and the loop's work between them, and step 4, which the crash cut short.
    assert math.isclose(s[C.WASTED_PROGRESS], 0.9 + 0.05 + (10.0 - 7.5), abs_tol=1e-6)
    assert math.isclose(s[C.CHECKPOINT_RESTORE], 0.4, abs_tol=1e-6)
    assert math.isclose(s[C.CHECKPOINT_SAVE], 0.02 + (14.6 - 14.5), abs_tol=1e-6)
    # Program startup: the spawn (0 -> 0.5) and both processes' imports (1.0 + 0.8).
    assert math.isclose(s[C.PROGRAM_STARTUP], 0.5 + 1.0 + 0.8, abs_tol=1e-6)
    # Recovery: from the crash to the restarted attempt's first step, less the startup,
    # rendezvous, set-up and restore inside it.
    assert math.isclose(s[C.INFRASTRUCTURE_RECOVERY], 11.0 - 10.0, abs_tol=1e-6)
    assert r["goodput"] == pytest.approx(s[C.PRODUCTIVE_STEP] / 15.0, abs=1e-5)
    (fault,) = r["faults"]  # logged twice (in place, then the restart): one fault
    assert fault["detail"] == "charged to a restart"
    assert fault["cost_s"][C.WASTED_PROGRESS] == pytest.approx(2 * 0.9)
    assert fault["cost_s"][C.INFRASTRUCTURE_RECOVERY] == pytest.approx(2 * 1.0)
    assert [a["attempt"] for a in r["attempts"]] == [0, 1]


def test_a_script_that_reports_no_steps_gets_no_goodput_but_its_restarts():
    ev = [e for e in _restarted_run() if e.get("source") == "agent"]
    r = account(ev)
    assert r["steps_known"] is False and r["goodput"] is None and r["world_size"] == 2
    assert r["seconds"][C.INFRASTRUCTURE_RECOVERY] == pytest.approx(10.3 - 10.0)
    assert len(r["faults"]) == 1


def test_clock_offsets_move_a_nodes_events_onto_the_leaders_clock(tmp_path):
    a, b = tmp_path / "node0", tmp_path / "node1"
    a.mkdir()
    b.mkdir()
    (a / "events.jsonl").write_text(json.dumps(_ev(10.0, "agent_start", node=0)) + "\n")
    (b / "events.jsonl").write_text(
        json.dumps(_ev(5.0, "clock_offset", node=1, offset=4.0, error=0.01)) + "\n"
        + json.dumps(_ev(7.0, "agent_start", node=1)) + "\n")
    ev = load_events([a, b, a])  # a dir given twice counts once
    assert [(e["event"], e["node"], e["t"]) for e in ev] == [
        ("clock_offset", 1, 9.0), ("agent_start", 0, 10.0), ("agent_start", 1, 11.0)]
