"""The follower role (every agent but the leader, standby nodes included): join each
attempt the leader opens, run this node's part of it, and exit by the leader's result."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from unbroken.control.clock import estimate_offset
from unbroken.control.messages import (
    AttemptPlan,
    DrainKind,
    DrainRequest,
    Fault,
    FaultKind,
    NodeJoin,
    NodeOut,
    Status,
)
from unbroken.control.retry import RetryingBackend
from unbroken.control.schema import (
    CURRENT,
    LEADER,
    LEADER_RECORD,
    RESULT,
    AttemptKeys,
    ack,
    follower_watch,
    node_out,
    waiting,
)
from unbroken.errors import ControlPlaneError, ExitCode
from unbroken.launch.attempt import Ending, Finished, Outcome
from unbroken.launch.election import WRONG_SECRET, HandedOver
from unbroken.launch.role import Role
from unbroken.launch.workers.spare_board import SpareBoard
from unbroken.polling import poll_until
from unbroken.telemetry import schema as ev

_LOOK = 0.02  # seconds between two looks while waiting: the role's sleep (the agent's default)


class Quarantined(Exception):  # noqa: N818 - control flow, not an error
    """The leader took this node out of the job for repeated faults."""


class Follower(Role):
    _sent: float | None = None  # this agent's wall time just before it wrote its last join
    _handoff: tuple[AttemptKeys, int] | None = None  # the drain asked for on SIGTERM
    _watching: tuple[int, object] | None = None  # (attempt, leader claim) the watch was made for

    def run(self, handed: HandedOver | None = None) -> int:
        """Follow attempt after attempt until the job's result. `handed`: this agent led
        until it handed the lead over; it follows that attempt first, its workers running."""
        seen = -1
        try:
            while True:
                if handed is not None:
                    attempt, handed = handed.attempt, None
                    seen = attempt
                    self._watch_keys(attempt)
                    outcome = self.watch.watch(lambda a=attempt: self._duties(a))
                else:
                    attempt = self._wait_next_attempt(seen)
                    seen = attempt
                    self._join(attempt)
                    self._watch_keys(attempt)
                    plan = self._wait_plan(attempt)
                    if plan is None:
                        continue
                    outcome = self.watch.run(attempt, plan, lambda a=attempt: self._duties(a))
                if outcome.ending == Ending.RELEASED:
                    return self._released()
                self.watch.stop_workers(attempt, outcome.fault)
        except Finished as fin:
            return self._finish(fin.result)
        except Quarantined:
            return self._released()

    def _finish(self, result: Any) -> int:
        if isinstance(self.channel.backend, RetryingBackend):
            self.channel.backend.stop_retrying()
        try:
            self.channel.write(ack(self.cfg.node_rank), True)
        except ControlPlaneError:
            pass  # the leader has already gone; the result is what counts
        if result.status == Status.SUCCESS:
            if self.channel.read(node_out(self.cfg.node_rank)) == NodeOut.QUARANTINED:
                # Quarantined with no rank left to drain, and the job ended before the
                # leader's order to leave came: still out of the job, not a node that
                # trained to the end.
                return self._released()
            self.say("job finished")
            return ExitCode.SUCCESS
        if result.status == Status.INTERRUPTED:
            self.say("the node-0 agent was interrupted; stopping")
            return 128 + int(result.signal or signal.SIGTERM)
        self._report_failure(result.fault, result.reason)
        return ExitCode.GAVE_UP

    def _released(self) -> int:
        """This node left the job on the leader's word: drained, or quarantined; each its
        own code, which a scheduler never counts as the job done (only 0 means that: every
        rank trained to the end)."""
        if self.channel.read(node_out(self.cfg.node_rank)) == NodeOut.QUARANTINED:
            self.events.emit(ev.NodeQuarantined(quarantined=self.cfg.node_rank))
            self.say("this node was quarantined after repeated faults: leaving the job "
                     f"(exit {int(ExitCode.QUARANTINED)})")
            return ExitCode.QUARANTINED
        self.say(f"every rank of this node moved to spares: it left the job (exit "
                 f"{int(ExitCode.DRAINED)})")
        return ExitCode.DRAINED

    def _duties(self, attempt: int) -> Outcome | None:
        """Watch the leader (with etcd: take over if it went silent). A node whose every rank
        was drained onto spares leaves the job."""
        if self.election is not None:
            self.election.watch(attempt)
            self._watch_keys(attempt)
        if self.outage_ended:
            self.outage_ended = False
            self._check_standing()
        sup, keys = self.watch.sup, AttemptKeys(attempt)
        if not (sup.workers and sup.all_exited_ok()):
            return None
        if not all(self.channel.read(keys.drained(w.wid)) for w in sup.workers):
            return None
        self.channel.write(keys.node_released(self.cfg.node_rank), True)
        self.events.emit(ev.NodeDrained(attempt=attempt))
        self.say("every rank of this node moved to spares: leaving the job")
        sup.stop_all()
        return Outcome(Ending.RELEASED)

    def _watch_keys(self, attempt: int) -> None:
        """With etcd: keep a live copy of what this agent's looks read, the leader's lease
        among them (made again when the attempt or the leader changes)."""
        claim = self.election.seen if self.election is not None else None
        if self.election is not None and claim is None:
            claim = self.channel.read(LEADER)
        if self._watching != (attempt, claim):
            self.channel.backend.watch(follower_watch(attempt, self.cfg.node_rank, claim))
            self._watching = (attempt, claim)

    def _check_standing(self) -> None:
        """After an outage of the control plane: if the leader declared this node lost
        meanwhile, its ranks have gone to others; it must not go on beside them."""
        record = self.channel.read(LEADER_RECORD)
        if record is not None and record.nodes.out.get(self.cfg.node_rank) == NodeOut.LOST:
            raise ControlPlaneError("this node was declared lost while it could not reach the "
                                    "control plane, and the job went on without it; restart "
                                    "its agent to rejoin")

    def _check_result(self) -> None:
        result = self.channel.read(RESULT)
        if result is not None:
            raise Finished(result)

    def _join(self, attempt: int) -> None:
        """Join as one of the job's nodes, or as a standby node: a standby node that took
        over a lost node's ranks is one of the job's nodes from then on (the leader's record)."""
        keys = AttemptKeys(attempt)
        record = self.channel.read(LEADER_RECORD)
        member = record is not None and self.cfg.node_rank in record.nodes.order
        self._sent = None
        if self.cfg.standby and not member:
            SpareBoard(self.channel, keys, self.cfg.node_rank).join_as_standby(self.instance)
            return
        self._sent = time.time()
        self.channel.first(keys.node_join(self.cfg.node_rank), NodeJoin(
            nproc=self.cfg.nproc_per_node, instance=self.instance, pid=os.getpid(),
            host=os.uname().nodename, sent=self._sent))

    def _measure_clock(self, plan: AttemptPlan, got: float) -> None:
        """This node's clock offset to the leader's, bounded by the rendezvous's own stamps
        (`control.clock`), as a `clock_offset` event; none when the bounds cross (a clock
        was stepped meanwhile) or the leader did not stamp the plan (an older leader)."""
        seen = plan.clock_seen.get(self.cfg.node_rank)
        if self._sent is None or seen is None or plan.clock_written is None:
            return
        estimate = estimate_offset(self._sent, seen, plan.clock_written, got)
        if estimate is not None:
            offset, error = estimate
            self.events.emit(ev.ClockOffset(attempt=plan.attempt, offset=round(offset, 6),
                                            error=round(error, 6)))

    def _wait_next_attempt(self, seen: int) -> int:
        def opened() -> int | None:
            self._check_result()
            if self.election is not None:
                self.election.watch(None)
            current = self.channel.read(CURRENT)
            if current is not None and current > seen:
                return int(current)
            if current is None and self.channel.signed_elsewhere(CURRENT):
                raise ControlPlaneError(WRONG_SECRET)
            return None

        return poll_until(opened, self.cfg.rdzv_timeout, _LOOK, sleep=lambda _: self._sleep(),
                          timeout_error=lambda: ControlPlaneError(
                              f"the node-0 agent opened no new attempt within "
                              f"{self.cfg.rdzv_timeout:g}s"))

    def _wait_plan(self, attempt: int) -> AttemptPlan | None:
        """The plan for this attempt, or None if it already runs without this agent."""
        keys = AttemptKeys(attempt)
        deadline = time.monotonic() + self.cfg.rdzv_timeout
        while True:
            self._check_result()
            if self.election is not None:
                self.election.watch(None)
            plan = self.channel.read(keys.plan)
            got = time.time()
            if plan is not None:
                mine = plan.nodes.get(self.cfg.node_rank)
                if mine is None and self.channel.read(node_out(self.cfg.node_rank)) \
                        == NodeOut.QUARANTINED:
                    raise Quarantined()
                if mine is None and self.cfg.standby:
                    return plan  # not in the plan: its spares wait to be handed a rank
                if mine is None and self.cfg.joins_freely:
                    # Elastic, beyond the cap or too late for this attempt: stand by with
                    # spares until the next one admits this node.
                    SpareBoard(self.channel, keys, self.cfg.node_rank).join_as_standby(
                        self.instance)
                    self.say(f"standing by in attempt {attempt}: the job has its "
                             f"{len(plan.nodes)} node(s)")
                    return plan
                if mine is None or mine.instance != self.instance:
                    # The leader waits for this agent's ack too at the job's end, so that
                    # its store (the TCPStore) is not gone before this agent reads the result.
                    self.channel.write(waiting(self.cfg.node_rank), self.instance)
                    return None
                self._measure_clock(plan, got)
                return plan
            current = self.channel.read(CURRENT)
            if current is not None and current > attempt:
                return None
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"no plan for attempt {attempt} within {self.cfg.rdzv_timeout:g}s")
            self._sleep()

    def hand_off(self) -> bool:
        """A drain of this whole node (`unbroken drain --node K`, asked by the node itself),
        while its workers train in place; the leader moves each rank to a ready spare and
        the node leaves once all have moved (`_duties`)."""
        watch = self.watch
        if not (watch.in_place and watch.resilient and watch.sup.workers):
            return False
        keys = watch.keys
        queue = keys.drains
        index = self.channel.position(queue, self.channel.append(
            queue, DrainRequest(DrainKind.NODE, self.cfg.node_rank)))
        self._handoff = (keys, index)
        self.say("SIGTERM: moving this node's ranks to spares before leaving")
        return True

    def hand_off_pending(self) -> bool:
        if self._handoff is None:
            return False
        keys, index = self._handoff
        outcome = self.channel.read(keys.drain_outcome(index))
        if outcome is not None and not outcome.ok:
            self.say(f"SIGTERM: the ranks cannot move ({outcome.error}); stopping")
            return False
        return True

    def interrupted(self, signum: int, held_ranks: bool = True) -> None:
        """Tell the leader this node stops: the attempt ends everywhere. A standby node that
        held no rank ends nothing: it only takes its spares away (a deleted standby pod
        must not restart the job); its lease then lapses, as a lost standby's does."""
        if self.cfg.standby and not held_ranks:
            self.say("a standby node holding no rank: leaving; the job goes on")
            return
        current = self.channel.read(CURRENT)
        if current is not None:
            self.watch.keys = AttemptKeys(current)
            self.watch.publish_fault(Fault(
                kind=FaultKind.AGENT_STOPPED, node=self.cfg.node_rank,
                detail=f"agent received {signal.Signals(signum).name}"), current)
            # Its workers are reaped (the agent stopped them first): the leader need not
            # wait out this node's lease before the next attempt, which waits for its return.
            self.channel.write(AttemptKeys(current).node_stopped(self.cfg.node_rank), True)
