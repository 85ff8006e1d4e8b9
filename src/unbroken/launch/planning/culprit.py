"""The culprit of a stalled generation (a hang), as a pure function of every node's report.

In lockstep training a hang stops every rank: the culprit, and the others blocked in a
collective, waiting for it. Heartbeat times alone cannot tell them apart (each node used to
kill its own longest-silent worker, so one hang killed one innocent per node). The leader
reads where every member stands (`StallReport`, one per node, written by its agent when its
workers stall) and decides, in this order:

1. A member whose process is stopped (its agent reads state `T` in /proc: SIGSTOP), or
   whose watchdog thread has not run for a whole step timeout outside a declared phase
   (nothing in it runs: a C call holding the GIL for ever), is the culprit. Such evidence
   needs no other node's report.
2. A member in a phase the script declared long (`run.phase("eval")`), or in a checkpoint
   or a recovery (bounded by their own, longer, timeouts), excuses the stall: the others
   wait for it by design.
3. Until every member is reported (a node that is cut off reports nothing; it is lost after
   `--node-timeout`, which is a death of its own), and past its own timeout, nobody is
   a culprit: a member that moves ends the stall.
4. The members behind the others (a lower (step, progress): they have not reached the
   collective the others wait in) are the culprits, if they are at most half the members:
   most ranks behind one means that one did more (an extra forward), not that the rest hang.
   A node that was unreported for more than `UNREACHABLE_AFTER` (its link was cut) settles
   first: the ranks behind may wait for its bytes, which TCP resends on a backoff that
   grows with the outage, so the blame waits as long again as the report was missing.
5. Every member alive, at the same point, and stalled: no single culprit (a network blip
   that TCP will ride out, a collective that no rank can finish, a shared file system that
   hangs). The planner waits up to its `stall_limit`, then restarts the attempt, charged once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from unbroken.control.heartbeat_page import PHASE_LONG, PHASE_TRAINING, STEPPING
from unbroken.control.messages import (
    Fault,
    FaultKind,
    NodeOrder,
    OrderKind,
    StallReport,
    WorkerProgress,
)
from unbroken.launch.planning.planner_commands import (
    Command,
    EndAction,
    EndAttempt,
    Order,
    Record,
    Say,
)
from unbroken.launch.planning.planner_state import Stalls
from unbroken.telemetry import schema as ev


class VerdictKind(StrEnum):
    KILL = "kill"  # the culprits are known: kill them, and only them
    EXCUSED = "excused"  # a member is in a declared long phase: no kill
    WAIT = "wait"  # not every member is reported yet
    STUCK = "stuck"  # every member stalled at the same point: no single culprit


@dataclass(frozen=True)
class Culprit:
    node: int
    worker: WorkerProgress


UNREACHABLE_AFTER = 1.0
"""Seconds a member's report may lag the others' before its node is taken as unreachable
(an agent reports within one look of its workers falling silent)."""


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    reason: str
    culprits: list[Culprit] = field(default_factory=list)
    behind: bool = False
    """A KILL for being behind the others (not for a stopped process): the one kind of
    evidence a partition can fake."""
    missing: bool = False
    """A WAIT for a member not reported yet."""


def frozen(w: WorkerProgress) -> bool:
    """Its process runs nothing: stopped, or its watchdog thread silent for a whole step
    timeout inside a step (not in a declared phase: a long C call there is allowed)."""
    return w.stopped or (w.phase == PHASE_TRAINING and w.frozen_for is not None
                         and w.frozen_for >= w.timeout)


def find_culprits(members: list[str], reports: dict[int, StallReport]) -> Verdict:
    """The verdict on a stall of the generation whose members are `members`, from the
    latest report of each node that sent one (reports of that generation only)."""
    placed = {w.wid: Culprit(node, w) for node, r in reports.items() for w in r.workers
              if w.wid in members}
    stopped = [c for c in placed.values() if c.worker.phase in STEPPING and frozen(c.worker)]
    if stopped:
        names = ", ".join(f"rank {c.worker.slot} (node {c.node})" for c in stopped)
        worst = max(c.worker.frozen_for or 0.0 for c in stopped)
        return Verdict(VerdictKind.KILL, f"{names} stopped: no thread of it ran for "
                       f"{worst:.1f}s while the others waited", stopped)
    long = [c for c in placed.values() if c.worker.phase == PHASE_LONG]
    if long:
        return Verdict(VerdictKind.EXCUSED, f"rank {long[0].worker.slot} is in a phase the "
                       "script declared long; the others wait for it")
    elsewhere = [c for c in placed.values() if c.worker.phase not in STEPPING]
    if elsewhere:  # a checkpoint or a recovery: bounded by its own, longer, timeout
        return Verdict(VerdictKind.EXCUSED, f"rank {elsewhere[0].worker.slot} is not "
                       f"stepping (phase {elsewhere[0].worker.phase}): its own timeout bounds it")
    missing = [m for m in members if m not in placed]
    if missing:
        return Verdict(VerdictKind.WAIT, f"no report yet on worker(s) {missing}", missing=True)
    moving = [c for c in placed.values() if c.worker.silent_for <= c.worker.timeout]
    if moving:  # the stall is ending (or this one was never part of it)
        return Verdict(VerdictKind.WAIT, f"rank {moving[0].worker.slot} is moving")
    position = {wid: (c.worker.step, c.worker.progress) for wid, c in placed.items()}
    low, high = min(position.values()), max(position.values())
    if low < high:
        behind = [placed[m] for m in members if position[m] == low]
        if 2 * len(behind) > len(members):
            return Verdict(VerdictKind.STUCK, f"{len(behind)} of {len(members)} ranks at step "
                           f"{low[0]} point {low[1]}, the rest further: no single culprit")
        names = ", ".join(f"rank {c.worker.slot} (node {c.node})" for c in behind)
        return Verdict(VerdictKind.KILL, f"{names} behind: step {low[0]} point {low[1]} while "
                       f"the others wait at step {high[0]} point {high[1]}", behind, behind=True)
    return Verdict(VerdictKind.STUCK, f"every rank stalled at step {low[0]} point {low[1]}, "
                   "all alive: no single culprit")


def _settle(stalls: Stalls, verdict: Verdict, now: float) -> tuple[float | None, float | None]:
    """(since when a member has been unreported, until when blame by position waits): a
    report that lagged more than `UNREACHABLE_AFTER` holds such blame as long again."""
    if verdict.missing:
        return (now if stalls.unreported_since is None else stalls.unreported_since,
                stalls.settle_until)
    if stalls.unreported_since is not None and now - stalls.unreported_since > UNREACHABLE_AFTER:
        return None, now + (now - stalls.unreported_since)
    return None, stalls.settle_until


def take_in_stalls(stalls: Stalls, reports: list[StallReport | None], members: list[str],
                   gen: int, running: bool, now: float, attempt: int,
                   stall_limit: float) -> tuple[Stalls, list[Command], EndAttempt | None]:
    """The planner's step on stalls (pure): take in the new reports of generation `gen`,
    and once every member's node has reported (or a process is seen stopped), order the
    culprits killed, once each. A stall with no culprit that outlives `stall_limit` ends
    the attempt for a full restart (the returned `EndAttempt`)."""
    latest = dict(stalls.reports)
    for report in filter(None, reports):
        if report.gen != gen:
            continue  # about a generation that is over
        if report.workers:
            latest[report.node] = report
        else:
            latest.pop(report.node, None)  # its workers move again
    if not running or not latest:
        return Stalls(reports=latest, culprits=stalls.culprits), [], None
    since = now if stalls.since is None else stalls.since
    verdict = find_culprits(members, latest)
    unreported, settle = _settle(stalls, verdict, now)
    if verdict.behind and settle is not None and now < settle:
        verdict = Verdict(VerdictKind.WAIT, f"{verdict.reason}, but a node was unreachable: "
                          f"its links settle until {settle - now:.1f}s from now")
    out: list[Command] = []
    if verdict.kind != VerdictKind.KILL and stalls.verdict != verdict.kind:
        out.append(Record(ev.Stall(gen=gen, verdict=verdict.kind.value,
                                       reason=verdict.reason)))
    killed = list(stalls.culprits)
    after = Stalls(reports=latest, since=since, culprits=killed, verdict=verdict.kind.value,
                   unreported_since=unreported, settle_until=settle)
    if verdict.kind == VerdictKind.KILL:
        for c in verdict.culprits:
            if c.worker.wid in killed:
                continue
            killed.append(c.worker.wid)
            out.append(Order(c.node, NodeOrder(OrderKind.KILL, slot=c.worker.slot,
                                               wid=c.worker.wid, reason=verdict.reason)))
            out.append(Record(ev.HangBlamed(
                gen=gen, wid=c.worker.wid, slot=c.worker.slot, culprit_node=c.node,
                step=c.worker.step, progress=c.worker.progress, reason=verdict.reason,
                reports=len(latest))))
        return after, out, None
    stalled = now - since
    # No culprit (yet): a network blip heals, a cut-off node is declared lost; a stall
    # that outlives both is a hang of the whole generation.
    if verdict.kind in (VerdictKind.STUCK, VerdictKind.WAIT) and stalled > stall_limit:
        why = f"stalled {stalled:.0f}s and nobody to blame: {verdict.reason}"
        fault = Fault(kind=FaultKind.HANG, attempt=attempt, detail=why)
        out.append(Say(f"hang with no single culprit ({why}): restarting every worker"))
        return after, out, EndAttempt(EndAction.RESTART, fault, why)
    return after, out, None
