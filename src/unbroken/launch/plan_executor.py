"""The thin executor around `planner.decide`: read the inbox from the store, decide, and
carry out the commands. All I/O of in-place recovery's planning is here; none of its logic.

Idle, it costs one store read per look (the attempt's news counter).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.control.channel import Channel
from unbroken.control.codec import from_plain, to_plain
from unbroken.control.messages import Fault, OrderKind
from unbroken.control.schema import AttemptKeys
from unbroken.launch.planner import (
    AnswerDrain,
    Command,
    EndAttempt,
    Inbox,
    MarkDrained,
    MarkFinished,
    Order,
    PlannerConfig,
    PlannerState,
    Record,
    Say,
    WritePlan,
    WriteTarget,
    decide,
    rebase,
)

_STALL_LOOK = 1.0  # seconds between looks at a stall while no news comes


@dataclass
class PersistedPlanner:
    """The planner's state as the executor writes it: plain values, and the clocks of the
    host that wrote it (monotonic, to move its deadlines; wall, for the time in between)."""

    state: dict[str, Any]
    monotonic: float
    wall: float


class PlanExecutor:
    def __init__(self, channel: Channel, state: PlannerState, config: PlannerConfig,
                 record: Callable[..., object], say: Callable[[str], None]) -> None:
        self.channel = channel
        self.state = state
        self.config = config
        self.keys = AttemptKeys(state.attempt)
        self.record = record
        self.say = say
        self._news = -1
        self._decided = 0.0  # monotonic time of the last decision
        self.deaths: list[Fault] = []  # taken in since the leader last looked (for blame)
        self._persisted: dict[str, Any] | None = None
        self.promoted: dict[int, int] = {}  # slot -> the node whose spare was ordered into it
        # The current generation's departures queue, and how many of its entries were read
        # (a successor starts again at 0: departures are taken in by wid, so twice is once).
        self._departures_gen, self._departures_seen = -1, 0

    def look(self, max_step: Callable[[], int], lost_nodes: list[int],
             standby_nodes: list[int], barred_nodes: list[int] = ()) -> EndAttempt | None:
        """Take in what happened, decide, act; an EndAttempt ends the attempt."""
        s = self.state
        news = self.channel.count(self.keys.news)
        fresh_lost = [n for n in lost_nodes if n not in s.lost_nodes]
        fresh_standby = [n for n in standby_nodes if n not in s.standby_nodes]
        fresh_barred = [n for n in barred_nodes if n not in s.barred_nodes]
        now = time.monotonic()
        # A stall nobody is blamed for yet is looked at again now and then (its limit).
        stalled = bool(s.stalls) and now - self._decided > _STALL_LOOK
        if news == self._news and not s.busy and not stalled \
                and not (fresh_lost or fresh_standby or fresh_barred):
            return None  # nothing happened
        self._news, self._decided = news, now
        inbox = self._gather(max_step(), fresh_lost, fresh_standby)
        inbox.barred_nodes = fresh_barred
        self.deaths += [d for d in inbox.deaths if d is not None]
        self.state, commands = decide(s, inbox, self.config)
        end = self._apply(commands)
        self._persist()  # after the commands: a successor may repeat some, never miss one
        return end

    def _persist(self) -> None:
        """Write the state, with this host's clocks, for a leader that takes over; only when
        it changed (a busy planner looks every few milliseconds)."""
        plain = to_plain(self.state)
        if plain == self._persisted:
            return
        self.channel.write(self.keys.planner_state, PersistedPlanner(
            state=plain, monotonic=time.monotonic(), wall=time.time()))
        self._persisted = plain

    @classmethod
    def resume(cls, channel: Channel, attempt: int, config: PlannerConfig,
               record: Callable[..., object], say: Callable[[str], None]) -> PlanExecutor | None:
        """The executor a new leader continues with: the persisted state, its clocks moved
        onto this host's; None if the old leader persisted none."""
        saved = channel.read(AttemptKeys(attempt).planner_state)
        if saved is None:
            return None
        saved = from_plain(PersistedPlanner, saved)
        shift = time.monotonic() - (time.time() - saved.wall) - saved.monotonic
        state = rebase(from_plain(PlannerState, saved.state), shift)
        return cls(channel, state, config, record, say)

    def _gather(self, max_step: int, lost: list[int], standby: list[int]) -> Inbox:
        s, ch, keys = self.state, self.channel, self.keys
        g = keys.gen(s.gen)
        inbox = Inbox(now=time.monotonic(), max_step=max_step, lost_nodes=lost, standby_nodes=standby,
                      deaths=ch.entries(keys.deaths, s.deaths_seen),
                      joiners=ch.entries(keys.joiners, s.joiners_seen),
                      drains=ch.entries(keys.drains, s.drains_seen),
                      stalls=ch.entries(keys.stalls, s.stalls_seen),
                      nup=ch.count(g.nup), ndone=ch.count(g.ndone))
        if self._departures_gen != s.gen:  # a new generation: its own queue
            self._departures_gen, self._departures_seen = s.gen, 0
        left = ch.entries(g.departures, self._departures_seen)
        self._departures_seen += len(left)
        inbox.nleft = len(s.departed) + len(left)
        for d in filter(None, left):  # None: forged, rejected
            inbox.departures[d.wid] = d
        nodes = [*s.standby_nodes, *standby, *s.nodes]
        if lost or any(inbox.drains) or any(d is not None and d.spare is None for d in inbox.deaths):
            offers = ch.read_many([keys.ready_spares(node) for node in nodes])
            for node, offered in zip(nodes, offers, strict=True):
                inbox.ready_spares += [(node, w) for w in offered or []]
        if lost or any(inbox.drains):
            inbox.hosted = dict(zip(nodes, ch.read_many([keys.hosted(n) for n in nodes]),
                                    strict=True))
        return inbox

    def _apply(self, commands: list[Command]) -> EndAttempt | None:
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
                    if order.kind == OrderKind.PROMOTE:
                        self.promoted[order.slot] = node
                case MarkDrained(wid):
                    ch.write(keys.drained(wid), True)
                case AnswerDrain(index, outcome):
                    ch.write(keys.drain_outcome(index), outcome)
                case MarkFinished():
                    ch.write(keys.finished, True)
                case Record(event, fields):
                    self.record(event, **fields)
                case Say(text):
                    self.say(text)
                case EndAttempt():
                    return c
        return None
