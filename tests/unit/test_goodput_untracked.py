"""Goodput of a script that reports no steps (`goodput._plain_segments`): the time its
processes ran is `untracked`, not `idle`. Hand-made events, no processes. (The rules for a
script that reports steps: test_goodput.py.)"""

from __future__ import annotations

import math

import pytest

from unbroken.telemetry.categories import Category
from unbroken.telemetry.goodput import account

C = Category


def _agent(t, event, node=0, **kw):
    return {"t": t, "event": event, "source": "agent", "node": node, **kw}


def _started(t, attempt, ranks, node=0):
    return _agent(t, "workers_started", node, attempt=attempt, duration=0.01,
                  pids={str(r): 100 * (attempt + 1) + r for r in ranks})


def _by_slot(report) -> dict[int, dict[str, float]]:
    for rank in report["ranks"]:
        assert math.isclose(sum(rank["seconds"].values()), report["wall_s"], abs_tol=1e-6)
    return {r["slot"]: r["seconds"] for r in report["ranks"]}


def test_a_plain_scripts_running_time_is_untracked_and_the_agents_wrap_up_idle():
    r = account([_agent(0.0, "agent_start"), _started(0.5, 0, (0, 1)),
                 _agent(10.0, "workers_done", attempt=0), _agent(10.5, "agent_exit", code=0)])
    assert r["steps_known"] is False and r["goodput"] is None and r["world_size"] == 2
    for s in _by_slot(r).values():
        assert s[C.PROGRAM_STARTUP] == pytest.approx(0.5)
        assert s[C.UNTRACKED] == pytest.approx(9.5)
        assert s[C.IDLE] == pytest.approx(0.5)
    assert r["badput_s"][C.UNTRACKED] == pytest.approx(9.5)
    assert C.UNTRACKED in r["categories"]


def test_a_fault_ends_the_attempts_untracked_time_and_its_restart_is_recovery():
    r = account([_agent(0.0, "agent_start"), _started(0.5, 0, (0, 1)),
                 _agent(4.0, "fault", kind="crash", rank=1, pid=101, attempt=0, step=None),
                 _agent(4.2, "workers_stopped", attempt=0, duration=0.2, reason="crash"),
                 _agent(4.3, "restart", attempt=1), _started(4.5, 1, (0, 1)),
                 _agent(9.0, "workers_done", attempt=1), _agent(9.5, "agent_exit", code=0)])
    for s in _by_slot(r).values():  # the survivor too: its attempt ended with the fault
        assert s[C.UNTRACKED] == pytest.approx((4.0 - 0.5) + (9.0 - 4.5))
        assert s[C.INFRASTRUCTURE_RECOVERY] == pytest.approx(4.5 - 4.0)
        assert s[C.IDLE] == pytest.approx(9.5 - 9.0)
    assert [a["seconds"][C.UNTRACKED] for a in r["attempts"]] == pytest.approx([3.5, 4.5])


def test_an_injected_fault_ends_the_untracked_time_at_its_injection():
    r = account([_agent(0.0, "agent_start"), _started(0.5, 0, (0,)),
                 {"t": 2.0, "event": "fault_injected", "source": "worker", "node": 0,
                  "rank": 0, "attempt": 0, "kind": "crash"},
                 _agent(2.1, "fault", kind="crash", rank=0, pid=100, attempt=0),
                 _agent(2.2, "workers_stopped", attempt=0, duration=0.0, reason="crash"),
                 _agent(3.0, "agent_exit", code=1)])
    (s,) = _by_slot(r).values()
    assert s[C.UNTRACKED] == pytest.approx(2.0 - 0.5)
    assert s[C.INFRASTRUCTURE_RECOVERY] == 0.0  # not restarted: the rest is idle
    assert s[C.IDLE] == pytest.approx(3.0 - 2.0)


def test_each_node_charges_its_own_ranks_from_its_start_to_its_end():
    r = account([_agent(0.0, "agent_start"), _agent(0.1, "agent_start", node=1),
                 _started(0.5, 0, (0, 1)), _started(1.0, 0, (2, 3), node=1),
                 _agent(8.0, "workers_done", attempt=0), _agent(9.0, "workers_done", node=1,
                                                                attempt=0),
                 _agent(9.5, "agent_exit", code=0), _agent(9.6, "agent_exit", node=1, code=0)])
    s = _by_slot(r)
    assert r["world_size"] == 4
    assert [s[slot][C.UNTRACKED] for slot in range(4)] == pytest.approx([7.5, 7.5, 8.0, 8.0])


def test_a_run_still_going_is_untracked_up_to_now():
    r = account([_agent(0.0, "agent_start"), _started(0.5, 0, (0,))], until=5.0)
    (s,) = _by_slot(r).values()
    assert s[C.UNTRACKED] == pytest.approx(4.5) and s[C.IDLE] == 0.0


def _w(t, event, slot, **kw):
    return {"t": t, "event": event, "source": "worker", "node": 0, "slot": slot, "rank": slot,
            **kw}


def test_a_script_that_reports_steps_has_nothing_untracked_even_in_a_stepless_attempt():
    ev = [_agent(0.0, "agent_start"), _started(0.5, 0, (0,)),
          _w(2.0, "worker_start", 0, attempt=0, world_size=1, startup=1.0, process_group=0.1)]
    ev += [_w(2.5 + 0.5 * k, "step", 0, attempt=0, gen=0, step=k, duration=0.4, loss=1.0)
           for k in range(3)]
    # attempt 1 dies during its start-up, before any step: the step rules keep charging it
    ev += [_agent(4.0, "fault", kind="crash", rank=0, pid=100, attempt=0),
           _agent(4.2, "restart", attempt=1), _started(4.3, 1, (0,)),
           _agent(5.0, "fault", kind="crash", rank=0, pid=200, attempt=1),
           _agent(5.5, "agent_exit", code=1)]
    r = account(ev)
    assert r["steps_known"] is True and r["goodput"] is not None
    (s,) = _by_slot(r).values()
    assert s[C.UNTRACKED] == 0.0
    assert s[C.PRODUCTIVE_STEP] == pytest.approx(3.5 - 2.1)
