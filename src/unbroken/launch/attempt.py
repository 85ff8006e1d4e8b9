"""One node's watch over one attempt, the same for leader and followers.

Each look: reap failed workers (in place: publish each death, promote a local ready spare;
otherwise publish the fault that ends the attempt), kill a hung worker (in place: report a
stall inside a step to the leader, which finds the culprit, and kill whom it orders), carry out the
leader's orders to this node, hand the switch target to the workers, offer spares, post
this node's `NodeDone`, and stop when the attempt's fault or the job's result is published.
The role's own duties (the leader's planning and node watch; a follower's release after a
drain) run in the same look, through `duties`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

from unbroken.control.channel import Channel
from unbroken.control.codec import to_plain
from unbroken.control.messages import (
    AttemptPlan,
    Fault,
    NodeDepartures,
    NodeDone,
    NodeOrder,
    OrderKind,
    Result,
)
from unbroken.control.schema import RESULT, AttemptKeys
from unbroken.launch.config import LaunchConfig
from unbroken.launch.planning.planner import EndAttempt
from unbroken.launch.workers.spare_board import SpareBoard
from unbroken.launch.workers.supervisor import NodeSupervisor
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EventLog


class Ending(StrEnum):
    DONE = "done"  # every rank of the world trained to the end
    FAULT = "fault"  # the attempt's fault was published
    RELEASED = "released"  # a drain moved every rank of this node away


@dataclass
class Outcome:
    ending: Ending
    fault: Fault | None = None
    end: EndAttempt | None = None  # the planner's verdict, when it ended the attempt


class Finished(Exception):  # noqa: N818 - control flow, not an error
    """The leader published the job's result."""

    def __init__(self, result: Result) -> None:
        super().__init__(result.status.value)
        self.result = result


class AttemptWatch:
    """The per-node loop of one attempt (see the module docstring)."""

    def __init__(self, cfg: LaunchConfig, channel: Channel, supervisor: NodeSupervisor,
                 events: EventLog, say: Callable[[str], None],
                 check_signal: Callable[[], None]) -> None:
        self.cfg = cfg
        self.channel = channel
        self.sup = supervisor
        self.events = events
        self.say = say  # the agent's one line to the user
        self.check_signal = check_signal
        self.in_place = cfg.in_place
        self.resilient = False
        self.busy = False  # the leader asks for fast looks while it recovers
        self.keys: AttemptKeys | None = None
        self.attempt = -1
        self._t0 = 0.0
        self._board: SpareBoard | None = None
        self._orders_seen = 0
        self._last_control = 0.0
        self.done_posted = False  # this node's NodeDone is written, for this attempt

    def publish_fault(self, fault: Fault, attempt: int) -> Fault:
        """Publish the fault that ends the attempt; the first one published wins."""
        fault = replace(fault, attempt=attempt, t=time.time(), reported_by=self.cfg.node_rank,
                        in_place=None)  # it ends the attempt: not recovered in place
        won = self.channel.first(self.keys.fault, fault)
        if won.t == fault.t and won.reported_by == fault.reported_by:
            self.events.emit(ev.Fault(**won.event_fields()))
            self.say(f"fault: {won.where()} {won.kind.value}: {won.detail}")
        return won

    def run(self, attempt: int, plan: AttemptPlan,
            duties: Callable[[], Outcome | None]) -> Outcome:
        """Start this node's part of `attempt` and watch it until it ends."""
        self.begin(attempt, plan)
        return self.watch(duties)

    def begin(self, attempt: int, plan: AttemptPlan) -> None:
        cfg, sup = self.cfg, self.sup
        self.keys = AttemptKeys(attempt)
        self.attempt = attempt
        self._t0 = t0 = time.monotonic()
        sup.start_attempt(attempt, plan)
        self.events.emit(ev.WorkersStarted(attempt=attempt,
                         duration=round(time.monotonic() - t0, 6),
                         pids={w.rank: w.pid for w in sup.workers}))
        if sup.standby:
            self.say(f"attempt {attempt}: standing by with {sup.spare_target} spare(s)")
        elif attempt == 0 or cfg.is_leader:
            ranks = [w.rank for w in sup.workers]
            self.say(f"attempt {attempt}: started ranks {ranks[0]}-{ranks[-1]} of {plan.world_size}")
        # Latched once every worker runs the resilient loop; a standby node's spares at once
        # (without in-place recovery, an elastic node standing by just waits: no spares).
        self.resilient = sup.standby and self.in_place
        self.busy = False
        self._board = SpareBoard(self.channel, self.keys, cfg.node_rank) if self.in_place else None
        self._orders_seen = 0
        self._last_control = 0.0
        self.done_posted = False

    def watch(self, duties: Callable[[], Outcome | None]) -> Outcome:
        """Watch the attempt `begin` started until it ends. A takeover of leadership leaves
        this loop by an exception from `duties` and enters it again, with the same workers,
        under the new role's duties."""
        while True:
            self.sup.wait(self._pause())
            outcome = self.look(duties)
            if outcome is not None:
                return outcome

    def look(self, duties: Callable[[], Outcome | None]) -> Outcome | None:
        """One look at the attempt (see the module docstring); its outcome once it ends.
        Raises `Finished` when the job's result is published, and whatever `duties` raise."""
        cfg, sup, ch, keys, attempt = self.cfg, self.sup, self.channel, self.keys, self.attempt
        self.check_signal()
        if self.in_place and not self.resilient:
            self.resilient = sup.all_resilient()
        failed = sup.exited()
        if self.resilient:
            for w in failed:
                if sup.finished_training(w):  # trained to the end, then failed to exit
                    fault = sup.reap(w)
                    self.events.emit(ev.ExitAfterDone(**fault.event_fields()))
                    continue
                self._death(attempt, sup.reap(w))
        else:
            fault = sup.attempt_failure(failed)
            if fault is not None:
                return Outcome(Ending.FAULT, self.publish_fault(fault, attempt))
        relayed = self._relay_departures()  # after the deaths: the planner sees them first
        hung = sup.hangs.find_hang(leader_finds_culprits=self.resilient)  # a death next look
        if hung is not None and not self.resilient:
            return Outcome(Ending.FAULT, self.publish_fault(hung, attempt))
        stall = sup.hangs.stall_report() if self.resilient else None
        spares_news = self.resilient and self._board.news([s.wid for s in sup.ready_spares()])
        if not self._control_due(bool(failed) or stall is not None or relayed or spares_news):
            return None
        if stall is not None:  # the leader finds the culprit (launch/planning/culprit.py)
            ch.append(keys.stalls, stall)
            self.events.emit(ev.StallReported(gen=stall.gen,
                             workers=[to_plain(w) for w in stall.workers]))
        # One round trip for what every look reads (etcd: each read is a request).
        fault, result, target = ch.read_many([keys.fault, RESULT, keys.target])
        if self.resilient:
            orders = ch.entries(keys.orders(cfg.node_rank), self._orders_seen)
            self._orders_seen += len(orders)
            for order in filter(None, orders):  # None: forged, rejected
                if self._obey(order) is not None:
                    return Outcome(Ending.RELEASED)
            if target is not None:
                sup.mirror_target(target)
            if sup.spare_target:
                sup.tend_spares(sup.training())
            ready = [s.wid for s in sup.ready_spares()]
            if self._board.offer(ready):
                self.events.emit(ev.SparesOffered(wids=ready))
            self._board.host({w.wid: w.rank for w in sup.workers
                              if w.proc.returncode in (None, 0)})
        if fault is not None:
            return Outcome(Ending.FAULT, fault)
        if result is not None:
            raise Finished(result)
        outcome = duties()
        if outcome is not None:
            return outcome
        if not self.done_posted and self._node_done(keys):
            ch.write(keys.node_done(cfg.node_rank), NodeDone(ranks=sup.finished_ranks()))
            self.events.emit(ev.WorkersDone(attempt=attempt))
            self.done_posted = True
        return None

    def _pause(self) -> float:
        """How long the next wait may be: short while the leader recovers, and no longer
        than the window of departures waiting here for the rest of this node's."""
        pause = 0.002 if self.busy else self.cfg.hangs.monitor_interval
        relay = self.sup.departures
        due = relay.gather.due_in(time.monotonic()) if relay is not None else None
        return pause if due is None else min(pause, due)

    def _relay_departures(self) -> bool:
        """Send on, in one append per generation, the departures this node's workers posted
        (`launch/workers/departure_relay.py`); whether any went."""
        relay = self.sup.departures
        if relay is None:
            return False
        now = time.monotonic()
        rejected = relay.rejected
        relay.receive(now)
        if relay.rejected > rejected:
            self.events.emit(ev.ForgedMessage(key=str(relay.path), reason="not a departure"))
        batches = relay.gather.take(self._members_in, now)
        for batch in batches:
            self.channel.append(AttemptKeys(batch.attempt).gen(batch.gen).departures,
                                NodeDepartures(node=self.cfg.node_rank,
                                               departures=batch.departures))
            self.events.emit(ev.DeparturesSent(gen=batch.gen, wids=batch.wids,
                                               waited=round(now - batch.since, 6)))
        return bool(batches)

    def _members_in(self, gen: int) -> set[str]:
        """The wids of this node's live workers whose heartbeat says they are in `gen`."""
        members = set()
        for w in self.sup.workers:
            beat = w.heartbeat.read() if w.proc.poll() is None else None
            if beat is not None and beat.generation == gen:
                members.add(w.wid)
        return members

    def _control_due(self, local_news: bool) -> bool:
        """Whether this look also reads the control plane. Every look does, except while
        the node is quiet (every worker here is training, nothing recovering, no exit
        seen, no change in its ready spares to offer); then every `cfg.quiet_poll`
        seconds. A fault anywhere makes the survivors here leave their generation within a
        step, which ends the quiet at once: recovery is not slowed, and a steady-state job
        does not load a shared control plane with twenty reads a second per agent."""
        now = time.monotonic()
        quiet = (self.cfg.quiet_poll > 0 and not local_news and not self.busy
                 and (not self.in_place or self.resilient) and self.sup.training())
        if quiet and now - self._last_control < self.cfg.quiet_poll:
            return False
        self._last_control = now
        return True

    def _node_done(self, keys: AttemptKeys) -> bool:
        """Every worker here exited 0, and trained to the end: some rank finished here, or
        the leader saw the final generation finish (a node left with no rank after a shrink)."""
        if not self.sup.all_exited_ok():
            return False
        return bool(self.sup.finished_ranks()) or bool(self.channel.read(keys.finished))

    def _death(self, attempt: int, fault: Fault) -> None:
        """A member died: promote a local ready spare into its slot, and tell the planner.
        The one place a death is published (a lost node's ranks are the planner's own)."""
        ready = self.sup.ready_spares()
        if ready:
            fault.spare = ready[0].wid  # the planner waits for it instead of shrinking
            self.sup.promote(ready[0], fault.slot, by="agent")
        fault.attempt, fault.t = attempt, time.time()
        self.channel.append(self.keys.deaths, fault)
        self.events.emit(ev.Fault(**fault.event_fields()))
        self.say(f"fault: rank {fault.rank} {fault.kind.value}: {fault.detail} (recovering in place)")

    def _obey(self, order: NodeOrder) -> NodeOrder | None:
        """Carry out one of the leader's orders to this node; returns a LEAVE order (this
        node leaves the job: its processes are stopped, without a death published)."""
        sup = self.sup
        if order.kind == OrderKind.LEAVE:
            sup.stop_all()
            self.channel.write(self.keys.node_released(self.cfg.node_rank), True)
            return order
        if order.kind == OrderKind.KILL:
            sup.hangs.kill_culprit(order)  # its death is published at the next look
            return None
        if order.kind == OrderKind.REPLACE:
            if sup.standby:
                return None  # a standby node starts no fresh workers
            sup.start_replacement(order.slot)
            return None
        spare = next((s for s in sup.ready_spares() if s.wid == order.spare), None)
        if spare is None:  # died, or promoted here in the meantime: the planner's wait is bounded
            self.events.emit(ev.SpareRequestDeclined(wid=order.spare, slot=order.slot))
            return None
        sup.promote(spare, order.slot, by="leader")
        return None

    def stop_workers(self, attempt: int, fault: Fault | None) -> None:
        """End this node's part of the attempt: stop and reap its processes, and say so."""
        t0 = time.monotonic()
        self.sup.stop_all()
        self.channel.write(AttemptKeys(attempt).node_stopped(self.cfg.node_rank), True)
        self.events.emit(ev.WorkersStopped(attempt=attempt, duration=round(time.monotonic() - t0, 6),
                         reason=fault.kind.value if fault else None))
