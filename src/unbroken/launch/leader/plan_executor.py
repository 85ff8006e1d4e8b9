"""The thin executor around `planner.decide`: read the inbox from the store, decide, and
carry out the commands. All I/O of the planner is here; none of its logic, and none of its
state: the leader holds the `PlannerState` and hands it to each `look`, which returns the
next one. What the executor reads (queues, counters, spares on offer) goes into the inbox;
it keeps only its own read cursors and pacing.

Idle, it costs no request with etcd (the leader's watch tells whether anything changed,
and its copy answers the reads), and on the TCPStore one read per look (the attempt's news
counter) and one for the standby queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from unbroken.control.channel import Channel
from unbroken.control.codec import from_plain, to_plain
from unbroken.control.schema import AttemptKeys, node_out
from unbroken.launch.planning import node_life
from unbroken.launch.planning.planner import decide
from unbroken.launch.planning.planner_commands import (
    AnswerDrain,
    Command,
    EndAttempt,
    MarkDrained,
    MarkFinished,
    MarkOut,
    Order,
    Record,
    Say,
    WritePlan,
    WriteTarget,
)
from unbroken.launch.planning.planner_state import Inbox, PlannerConfig, PlannerState, rebase

_STALL_LOOK = 1.0  # seconds between looks at a stall while no news comes


@dataclass
class PersistedPlanner:
    """The planner's state as the executor writes it: plain values, and the clocks of the
    host that wrote it (monotonic, to move its deadlines; wall, for the time in between)."""

    state: dict[str, Any]
    monotonic: float
    wall: float


class PlanExecutor:
    def __init__(self, channel: Channel, attempt: int, config: PlannerConfig,
                 record: Callable[..., object], say: Callable[[str], None]) -> None:
        self.channel = channel
        self.config = config
        self.keys = AttemptKeys(attempt)
        self.record = record
        self.say = say
        self._news = -1
        self._decided = 0.0  # monotonic time of the last decision
        self._persisted: dict[str, Any] | None = None
        # The current generation's departures queue, and how many of its entries were read
        # (a successor starts again at 0: departures are taken in by wid, so twice is once).
        self._departures_gen, self._departures_seen = -1, 0

    def look(self, s: PlannerState, inbox: Inbox,
             max_step: Callable[[], int] = lambda: 0) -> tuple[PlannerState, EndAttempt | None]:
        """Take in what happened, decide, act. `inbox` holds the leader's news of its nodes
        (lease silences, strikes, a predecessor); this adds what the store says. Returns the
        next state, and the EndAttempt that ends the attempt, if one does."""
        ch, keys = self.channel, self.keys
        news = ch.news(keys.news) if inbox.in_place else self._news
        inbox.standbys = ch.entries(keys.standbys, s.seen.standbys)
        losing = node_life.losing(s.nodes, inbox.silences, inbox.released,
                                  self.config.node_timeout, inbox.predecessor)
        # A stall with no culprit yet is looked at again now and then (its limit).
        stalled = bool(s.stalls.reports) and inbox.now - self._decided > _STALL_LOOK
        fresh = bool(losing or inbox.strikes or inbox.standbys) \
            or node_life.news(s.nodes, inbox.silences, self.config.node_timeout)
        if news == self._news and not (inbox.in_place and (s.busy or stalled)) and not fresh:
            return s, None  # nothing happened
        self._news, self._decided = news, inbox.now
        if inbox.in_place:
            inbox.max_step = max_step()
            self._gather(s, inbox, losing)
        state, commands = decide(s, inbox, self.config)
        end = self.carry_out(commands)
        self._persist(state)  # after the commands: a successor may repeat some, never miss one
        return state, end

    def _persist(self, state: PlannerState) -> None:
        """Write the state, with this host's clocks, for a leader that takes over; only when
        it changed (a busy planner looks every few milliseconds). Less its departures: a
        successor reads the generation's departures queue again from its start (by wid:
        twice is once), and they are most of the state at scale, changing at every look of
        a recovery (2,048 of them: 20 ms of encoding a look, and as many kB written)."""
        plain = to_plain(replace(state, departed={}))
        if plain == self._persisted:
            return
        self.channel.write(self.keys.planner_state, PersistedPlanner(
            state=plain, monotonic=time.monotonic(), wall=time.time()))
        self._persisted = plain

    @staticmethod
    def resume(channel: Channel, attempt: int) -> PlannerState | None:
        """The state a new leader continues with: the persisted one, its clocks moved onto
        this host's; None if the old leader persisted none."""
        saved = channel.read(AttemptKeys(attempt).planner_state)
        if saved is None:
            return None
        saved = from_plain(PersistedPlanner, saved)
        shift = time.monotonic() - (time.time() - saved.wall) - saved.monotonic
        return rebase(from_plain(PlannerState, saved.state), shift)

    def _gather(self, s: PlannerState, inbox: Inbox, losing: list[int]) -> None:
        """Fill `inbox` with the in-place queues' new entries and the generation's counts;
        with the spares on offer and who hosts what when a node is lost or drained."""
        ch, keys = self.channel, self.keys
        g = keys.gen(s.gen)
        inbox.deaths = ch.entries(keys.deaths, s.seen.deaths)
        inbox.joiners = ch.entries(keys.joiners, s.seen.joiners)
        inbox.drains = ch.entries(keys.drains, s.seen.drains)
        inbox.stalls = ch.entries(keys.stalls, s.seen.stalls)
        inbox.nup, inbox.ndone = ch.count(g.nup), ch.count(g.ndone)
        if self._departures_gen != s.gen:  # a new generation: its own queue
            self._departures_gen, self._departures_seen = s.gen, 0
        left = ch.entries(g.departures, self._departures_seen)  # a node's gathering each
        self._departures_seen += len(left)
        inbox.nleft = len(s.departed) + sum(len(n.departures) if n else 1 for n in left)
        for node in filter(None, left):  # None: forged, rejected
            for d in node.departures:
                inbox.departures[d.wid] = d
        standby = [j.node for j in inbox.standbys if j is not None and j.node not in s.nodes.standby]
        nodes = [*s.nodes.standby, *standby, *s.nodes.planned]
        drains = any(inbox.drains) or bool(s.drains.held)
        if losing or drains or any(d is not None and d.spare is None for d in inbox.deaths):
            offers = ch.read_many([keys.ready_spares(node) for node in nodes])
            for node, offered in zip(nodes, offers, strict=True):
                inbox.ready_spares += [(node, w) for w in offered or []]
        if losing or drains:
            inbox.hosted = dict(zip(nodes, ch.read_many([keys.hosted(n) for n in nodes]),
                                    strict=True))

    def carry_out(self, commands: list[Command]) -> EndAttempt | None:
        """Carry out the planner's commands, up to the first EndAttempt (returned)."""
        ch, keys = self.channel, self.keys
        for c in commands:
            match c:
                case WriteTarget(target):
                    ch.write(keys.target, target)
                case WritePlan(plan):
                    ch.write(keys.gen(plan.gen).plan, plan)
                    ch.write(keys.latest_gen, plan.gen)  # after the plan: readers find it
                case Order(node, order):
                    ch.append(keys.orders(node), order)
                case MarkDrained(wid):
                    ch.write(keys.drained(wid), True)
                case MarkOut(node, why):
                    ch.write(node_out(node), why)
                case AnswerDrain(index, outcome):
                    ch.write(keys.drain_outcome(index), outcome)
                case MarkFinished():
                    ch.write(keys.finished, True)
                case Record(body):
                    self.record(body)
                case Say(text):
                    self.say(text)
                case EndAttempt():
                    return c
        return None
