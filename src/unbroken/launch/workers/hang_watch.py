"""This node's watch for hung workers, read from their heartbeat pages.

Two ways, by the kind of recovery:
- Without in-place recovery, and for any phase outside a step (start-up, a checkpoint, a
  recovery) that outlives its own timeout: the node kills its overdue worker itself
  (`find_hang`). A stopped process is the culprit; otherwise the overdue worker silent the
  longest.
- In place, a stall inside a step is not decided here: the node reports where its workers
  stand (`stall_report`), the leader finds the culprit from every node's report
  (`launch/planning/culprit.py`), and orders its node to kill it (`kill_culprit`).

Either way the hung worker is SIGKILLed with a `Fault` of kind HANG attached; its death is
then seen, and published, like any other.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from unbroken.control.heartbeat_page import STEPPING
from unbroken.control.messages import Fault, FaultKind, NodeOrder, StallReport, WorkerProgress
from unbroken.launch.planning.culprit import frozen
from unbroken.launch.workers.worker_process import WorkerProcess

HANG_QUIET = 3.0  # after a hang kill, seconds before another worker may be declared hung
DUMP_WAIT = 1.0  # seconds a blamed worker's flight-recorder dump may hold up its kill


class HangWatch:
    """The hang watch of one node's workers (`workers()`: the supervisor's, as they are now)."""

    def __init__(self, node: int, workers: Callable[[], list[WorkerProcess]]) -> None:
        self.node = node
        self._workers = workers
        self._quiet_until = 0.0
        self._stall_key: tuple | None = None  # what this node last reported of a stall

    def new_attempt(self) -> None:
        """A new attempt's workers: nothing of theirs has been reported yet."""
        self._stall_key = None

    def find_hang(self, leader_finds_culprits: bool) -> Fault | None:
        """Kill the hung worker, if one is overdue; its death is then seen like any other.

        `leader_finds_culprits` (in place): a stall inside a step is the leader's to decide
        (`stall_report`, `launch/planning/culprit.py`); only a start-up, checkpoint or recovery that
        outlives its own timeout is decided here."""
        now = time.monotonic()
        if now < self._quiet_until:
            return None  # peers of a worker just killed for hanging are still unblocking
        beating, overdue = [], []
        for w in self._workers():
            if w.proc.returncode is not None:
                continue
            beat = w.heartbeat.read()
            if beat is None:
                continue
            w.hang.observe(beat)
            beating.append(w)
            if leader_finds_culprits and beat.phase in STEPPING:
                continue
            if w.hang.overdue(now) is not None:
                overdue.append(w)
        if not overdue:
            return None
        # Once anyone is overdue, its peers are usually blocked on the culprit. A stopped
        # process is the culprit; otherwise the overdue worker silent the longest.
        stopped = [w for w in beating if is_stopped(w.pid)]
        w = stopped[0] if stopped else min(overdue, key=lambda w: w.hang.last_beat.monotonic)
        timeout = w.hang.overdue(now) or w.hang.step_timeout()
        beat = w.hang.last_beat
        silent = now - beat.monotonic
        self._kill_hung(w, timeout, f"no heartbeat for {silent:.1f}s (timeout {timeout:.1f}s); killed")
        return w.fault

    def _kill_hung(self, w: WorkerProcess, timeout: float, detail: str) -> None:
        """SIGKILL a hung worker (reaped, with a bound, by stop_workers or reap) and note why."""
        now = time.monotonic()
        beat = w.hang.last_beat
        silent = now - beat.monotonic if beat is not None else 0.0
        os.kill(w.pid, signal.SIGKILL)
        self._quiet_until = now + HANG_QUIET
        w.fault = Fault(kind=FaultKind.HANG, rank=w.rank, node=self.node, pid=w.pid,
                        step=beat.step if beat is not None else None, silent_for=round(silent, 3),
                        hang_started=round(time.time() - silent, 6), timeout=round(timeout, 3),
                        detail=detail)

    def stall_report(self) -> StallReport | None:
        """In place: where this node's workers stand, once one of them has been inside its
        step past its step timeout (a report with no workers once all move again); None
        when nothing changed since the last report. Read from the heartbeat pages only."""
        now = time.monotonic()
        beats = {}
        workers = self._workers()
        for w in workers:
            beat = w.heartbeat.read() if w.proc.poll() is None else None
            if beat is None or beat.generation < 0:
                continue  # exited, or joining: not a member the leader weighs
            w.hang.observe(beat)
            beats[w.wid] = beat
        gens = {b.generation for b in beats.values()}
        if len(gens) != 1:
            return None  # nobody here to weigh, or mid-switch
        live = [w for w in workers if w.wid in beats]
        stalled = any(beats[w.wid].phase in STEPPING
                      and w.hang.silent_for(now) > w.hang.step_timeout() for w in live)
        quiet_before = self._stall_key is None or not self._stall_key[1]
        if not stalled and quiet_before:
            return None  # the usual look: nothing to say, and nothing read from /proc
        progress = [WorkerProgress(
            wid=w.wid, slot=w.rank, step=beats[w.wid].step, progress=beats[w.wid].progress,
            phase=beats[w.wid].phase, silent_for=round(w.hang.silent_for(now), 3),
            frozen_for=(round(now - beats[w.wid].alive, 3)
                        if beats[w.wid].alive is not None else None),
            timeout=round(w.hang.step_timeout(), 3), stopped=is_stopped(w.pid))
            for w in live] if stalled else []
        report = StallReport(node=self.node, gen=gens.pop(), workers=progress)
        key = (report.gen, tuple((p.wid, p.step, p.progress, p.phase, frozen(p),
                                  p.silent_for > p.timeout) for p in report.workers))
        if key == self._stall_key:
            return None
        self._stall_key = key
        return report

    def kill_culprit(self, order: NodeOrder) -> bool:
        """The leader found worker `order.wid` the culprit of a hang: kill it (its death is
        published like any other). False if it is no longer here or already dead."""
        w = next((w for w in self._workers() if w.wid == order.wid), None)
        if w is None or w.proc.poll() is not None:
            return False
        ask_dump(w)
        # The detail's words are the users' (logs, the report): kept as they were.
        self._kill_hung(w, w.hang.step_timeout(), f"blamed by the leader: {order.reason}; killed")
        return True


def ask_dump(w: WorkerProcess) -> bool:
    """Before a blamed worker is killed: ask its watchdog thread to dump torch's flight
    recorder (it does where the worker turned the recorder on: `runtime/generations/flight_recorder.py`),
    and wait up to `DUMP_WAIT` for it. Not asked of a process that cannot answer: stopped,
    or whose watchdog has not ticked for a second. True if it answered."""
    beat = w.heartbeat.read()
    if beat is None or beat.alive is None or time.monotonic() - beat.alive > 1.0 \
            or is_stopped(w.pid):
        return False
    asked = w.heartbeat.ask_dump()
    deadline = time.monotonic() + DUMP_WAIT
    while asked is not None and time.monotonic() < deadline:
        if w.heartbeat.dump_served(asked):
            return True
        time.sleep(0.01)
    return False


def is_stopped(pid: int) -> bool:
    """Its state in /proc is `T` or `t`: stopped (SIGSTOP), or stopped by a tracer."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")
