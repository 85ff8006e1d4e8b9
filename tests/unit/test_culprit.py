"""The culprit of a stalled generation, and the planner's use of it: pure functions, no processes.

Each case is a picture of a hang as the nodes' agents report it (`StallReport`): who is
stopped, who is behind, who is in a declared long phase, who is not reported yet.
"""

from __future__ import annotations

from unbroken.control.messages import FaultKind, OrderKind, StallReport, WorkerProgress
from unbroken.launch.planning.budget import RestartBudget
from unbroken.launch.planning.culprit import VerdictKind, find_culprits
from unbroken.launch.planning.planner import decide
from unbroken.launch.planning.planner_commands import EndAction, EndAttempt, Order, Record
from unbroken.launch.planning.planner_state import Inbox, PlannerConfig, initial_state
from unbroken.launch.workers.hang_detector import HangDetector, percentile
from unbroken.runtime.heartbeat import PHASE_CHECKPOINT, PHASE_LONG, PHASE_TRAINING, Beat

MEMBERS = ["0.0", "1.0", "2.0", "3.0"]


def worker(slot, step=12, progress=2, phase=PHASE_TRAINING, silent=1.2, frozen=0.01,
           timeout=1.0, stopped=False) -> WorkerProgress:
    return WorkerProgress(wid=f"{slot}.0", slot=slot, step=step, progress=progress, phase=phase,
                          silent_for=silent, frozen_for=frozen, timeout=timeout, stopped=stopped)


def reports(*workers: WorkerProgress, gen=0) -> dict[int, StallReport]:
    """Two nodes, two workers each (slots 0-1 on node 0, 2-3 on node 1)."""
    by_node: dict[int, StallReport] = {}
    for w in workers:
        by_node.setdefault(w.slot // 2, StallReport(node=w.slot // 2, gen=gen)).workers.append(w)
    return by_node


def test_a_stopped_process_is_the_culprit_without_waiting_for_the_other_node():
    v = find_culprits(MEMBERS, reports(worker(2), worker(3, progress=0, frozen=1.1)))
    assert v.kind == VerdictKind.KILL
    assert [(c.node, c.worker.wid) for c in v.culprits] == [(1, "3.0")]
    assert "stopped" in v.reason


def test_a_rank_behind_the_others_is_the_only_culprit_once_every_node_reported():
    stuck = [worker(0), worker(1), worker(2), worker(3, progress=0)]  # alive, before its forward
    assert find_culprits(MEMBERS, reports(*stuck[2:])).kind == VerdictKind.WAIT  # node 0 not heard yet
    v = find_culprits(MEMBERS, reports(*stuck))
    assert v.kind == VerdictKind.KILL and [c.worker.slot for c in v.culprits] == [3]
    assert "behind" in v.reason


def test_a_rank_a_step_behind_is_the_culprit():
    v = find_culprits(MEMBERS, reports(worker(0, step=13, progress=0), worker(1, step=13, progress=0),
                               worker(2, step=13, progress=0), worker(3, step=12, progress=2)))
    assert [c.worker.slot for c in v.culprits] == [3]


def test_a_declared_long_phase_excuses_the_wait():
    v = find_culprits(MEMBERS, reports(worker(0, progress=0, phase=PHASE_LONG, silent=5), worker(1),
                               worker(2), worker(3)))
    assert v.kind == VerdictKind.EXCUSED


def test_a_rank_that_moves_again_ends_the_stall():
    v = find_culprits(MEMBERS, reports(worker(0, silent=0.1), worker(1), worker(2), worker(3)))
    assert v.kind == VerdictKind.WAIT


def test_a_checkpoint_is_bounded_by_its_own_timeout_and_no_culprit():
    v = find_culprits(MEMBERS, reports(worker(0, phase=PHASE_CHECKPOINT, progress=0), worker(1),
                               worker(2), worker(3)))
    assert v.kind == VerdictKind.EXCUSED


def test_a_process_seen_stopped_in_proc_is_the_culprit_even_with_a_fresh_tick():
    v = find_culprits(MEMBERS, reports(worker(0), worker(1, stopped=True, frozen=0.0)))
    assert v.kind == VerdictKind.KILL and [c.worker.slot for c in v.culprits] == [1]


def test_a_long_c_call_inside_a_declared_phase_is_not_a_stopped_process():
    v = find_culprits(MEMBERS, reports(worker(0, phase=PHASE_LONG, frozen=30, silent=30), worker(1),
                               worker(2), worker(3)))
    assert v.kind == VerdictKind.EXCUSED


def test_most_ranks_behind_one_is_no_culprit_that_one_did_more():
    v = find_culprits(MEMBERS, reports(worker(0, progress=4), worker(1), worker(2), worker(3)))
    assert v.kind == VerdictKind.STUCK  # rank 0 ran an extra forward; nobody is killed
    v = find_culprits(["0.0", "1.0"], {0: StallReport(0, 0, [worker(0, progress=0), worker(1)])})
    assert [c.worker.slot for c in v.culprits] == [0]  # one of two: it is the one behind


def test_everyone_alive_at_the_same_point_is_stuck_with_no_single_culprit():
    v = find_culprits(MEMBERS, reports(*(worker(s) for s in range(4))))
    assert v.kind == VerdictKind.STUCK and not v.culprits


def test_a_watchdog_a_little_late_is_not_a_stopped_process():
    v = find_culprits(MEMBERS, reports(worker(0, frozen=0.8), worker(1), worker(2), worker(3)))
    assert v.kind == VerdictKind.STUCK  # 0.8 s < its 1 s timeout: not frozen


def test_workers_that_are_not_members_are_ignored():
    extra = WorkerProgress(wid="3.1", slot=3, step=0, progress=0, phase=PHASE_TRAINING,
                           silent_for=9, frozen_for=9, timeout=1)
    v = find_culprits(["0.0", "1.0"], {0: StallReport(0, 0, [worker(0), worker(1)]),
                               1: StallReport(1, 0, [extra])})
    assert v.kind == VerdictKind.STUCK


# ---------------------------------------------------------------- the planner
DEFAULT = PlannerConfig()


def _decide(state, now=100.0, config=DEFAULT, **inbox):
    return decide(state, Inbox(now=now, **inbox), config)


def test_one_hang_seen_by_two_nodes_is_one_kill_order_then_one_charged_death():
    s = initial_state(0, 4, [0, 1], RestartBudget(3))
    node1 = StallReport(1, 0, [worker(2), worker(3, progress=0, frozen=1.5)])
    node0 = StallReport(0, 0, [worker(0), worker(1)])
    s, out = _decide(s, stalls=[node1])
    kills = [c for c in out if isinstance(c, Order)]
    assert [(k.node, k.order.kind, k.order.wid, k.order.slot) for k in kills] == \
        [(1, OrderKind.KILL, "3.0", 3)]
    assert s.budget.spent == 0  # the kill is not the charge: the death it causes is
    s, out = _decide(s, stalls=[node0], now=100.2)  # the other node's report: no second kill
    assert not [c for c in out if isinstance(c, Order)]
    assert s.stalls.culprits == ["3.0"]


def test_a_stall_report_of_an_older_generation_is_ignored():
    s = initial_state(0, 4, [0, 1], RestartBudget(3))
    s.gen = 2
    s, out = _decide(s, stalls=[StallReport(1, 1, [worker(3, progress=0, frozen=5)])])
    assert not out and not s.stalls.reports


def test_a_stall_with_no_single_culprit_is_ridden_out_then_restarts_the_attempt_once():
    s = initial_state(0, 4, [0, 1], RestartBudget(3))
    config = PlannerConfig(stall_limit=30)
    s, out = _decide(s, config=config, stalls=[StallReport(0, 0, [worker(0), worker(1)]),
                                               StallReport(1, 0, [worker(2), worker(3)])])
    assert [c.fields["verdict"] for c in out if isinstance(c, Record)] == ["stuck"]
    assert not [c for c in out if isinstance(c, (EndAttempt, Order))]  # a blip heals
    s, out = _decide(s, now=131, config=config)
    (end,) = [c for c in out if isinstance(c, EndAttempt)]
    assert end.action == EndAction.RESTART and end.fault.kind == FaultKind.HANG


def test_an_unreported_node_is_waited_for_up_to_the_stall_limit():
    s = initial_state(0, 4, [0, 1], RestartBudget(3))
    config = PlannerConfig(stall_limit=30)
    s, out = _decide(s, config=config, stalls=[StallReport(0, 0, [worker(0), worker(1)])])
    assert [c.fields["verdict"] for c in out if isinstance(c, Record)] == ["wait"]
    s, out = _decide(s, now=120, config=config)
    assert not [c for c in out if isinstance(c, EndAttempt)]
    s, out = _decide(s, now=131, config=config)
    assert [c.action for c in out if isinstance(c, EndAttempt)] == [EndAction.RESTART]


def test_a_cleared_report_ends_the_stall():
    s = initial_state(0, 4, [0, 1], RestartBudget(3))
    s, _ = _decide(s, stalls=[StallReport(0, 0, [worker(0), worker(1)])])
    s, out = _decide(s, stalls=[StallReport(0, 0, [])], now=101)
    assert not s.stalls.reports and s.stalls.since is None and not out


# ---------------------------------------------------------------- the timeout
def test_the_default_hang_timeout_is_three_times_the_p99_step_with_a_one_second_floor():
    d = HangDetector()
    t = 0.0
    for step in range(300):  # 50 ms steps, one in fifty three times slower
        d.observe(Beat(step=step, monotonic=t, phase=PHASE_TRAINING, pid=1))
        t += 0.15 if step % 50 == 0 else 0.05
    assert d.step_timeout() == 1.0  # 3 x 0.15 s is under the floor
    for step in range(300, 600):  # 1 s steps now
        d.observe(Beat(step=step, monotonic=t, phase=PHASE_TRAINING, pid=1))
        t += 1.0
    assert abs(d.step_timeout() - 3.0) < 1e-9
    assert percentile([1, 2, 3, 4, 100], 0.99) == 100 and percentile([5], 0.5) == 5


def test_the_first_step_after_a_recovery_gets_five_timeouts_and_a_checkpoint_is_no_step():
    from unbroken.runtime.heartbeat import PHASE_CHECKPOINT as CKPT
    from unbroken.runtime.heartbeat import PHASE_RECOVERY

    d = HangDetector()
    for step in range(10):
        d.observe(Beat(step=step, monotonic=step * 0.05, phase=PHASE_TRAINING, pid=1))
    d.observe(Beat(step=10, monotonic=0.5, phase=CKPT, pid=1))
    d.observe(Beat(step=11, monotonic=9.5, phase=PHASE_TRAINING, pid=1))
    assert d.step_timeout() == 1.0  # the 9 s checkpoint was no step time
    d.observe(Beat(step=11, monotonic=9.6, phase=PHASE_RECOVERY, pid=1))
    d.observe(Beat(step=11, monotonic=9.8, phase=PHASE_TRAINING, pid=1))
    assert d.overdue(9.8 + 4.0) is None and d.overdue(9.8 + 5.5) == 5.0  # first step: 5 x
    d.observe(Beat(step=12, monotonic=10.0, phase=PHASE_TRAINING, pid=1))
    assert d.overdue(10.0 + 1.5) == 1.0  # the next one: the usual timeout


def test_a_declared_long_phase_has_no_timeout_and_is_no_step_time():
    d = HangDetector()
    d.observe(Beat(step=0, monotonic=0.0, phase=PHASE_TRAINING, pid=1))
    d.observe(Beat(step=1, monotonic=0.05, phase=PHASE_TRAINING, pid=1))
    d.observe(Beat(step=1, monotonic=0.06, phase=PHASE_LONG, pid=1))
    assert d.overdue(100.0) is None
    d.observe(Beat(step=2, monotonic=10.0, phase=PHASE_TRAINING, pid=1))
    assert d.timed_steps == 1 and d.step_timeout() == 1.0


def test_a_rank_behind_after_a_node_was_unreachable_is_blamed_only_once_its_links_settle():
    """A cut node's report comes late; the rank behind may wait for its resent bytes."""
    s = initial_state(0, 4, [0, 1], RestartBudget(3))
    config = PlannerConfig(stall_limit=60)
    s, out = _decide(s, config=config, stalls=[StallReport(0, 0, [worker(0), worker(1)])])
    assert not [c for c in out if isinstance(c, Order)]  # node 1 unreported: cut off
    late = StallReport(1, 0, [worker(2), worker(3, progress=0)])  # rank 3 behind
    s, out = _decide(s, now=104.0, config=config, stalls=[late])  # 4 s late
    assert not [c for c in out if isinstance(c, Order)]
    s, out = _decide(s, now=107.5, config=config)  # still settling (until 108)
    assert not [c for c in out if isinstance(c, Order)]
    s, out = _decide(s, now=108.5, config=config)  # settled, still behind: the culprit
    assert [c.order.wid for c in out if isinstance(c, Order)] == ["3.0"]


def test_a_report_a_moment_late_does_not_delay_the_blame():
    s = initial_state(0, 4, [0, 1], RestartBudget(3))
    s, _ = _decide(s, stalls=[StallReport(0, 0, [worker(0), worker(1)])])
    s, out = _decide(s, now=100.4, stalls=[StallReport(1, 0, [worker(2), worker(3, progress=0)])])
    assert [c.order.wid for c in out if isinstance(c, Order)] == ["3.0"]
