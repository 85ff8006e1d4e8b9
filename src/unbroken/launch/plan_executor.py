"""The thin executor around `planner.decide`: read the inbox from the store, decide, and
carry out the commands. All I/O of in-place recovery's planning is here; none of its logic.

Idle, it costs one store read per look (the attempt's news counter).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from unbroken.control.channel import Channel
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
)


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

    def look(self, max_step: Callable[[], int], lost_nodes: list[int],
             standby_nodes: list[int]) -> EndAttempt | None:
        """Take in what happened, decide, act; an EndAttempt ends the attempt."""
        s = self.state
        news = self.channel.count(self.keys.news)
        fresh_lost = [n for n in lost_nodes if n not in s.lost_nodes]
        fresh_standby = [n for n in standby_nodes if n not in s.standby_nodes]
        if news == self._news and not s.busy and not fresh_lost and not fresh_standby:
            return None  # nothing happened
        self._news = news
        inbox = self._gather(max_step(), fresh_lost, fresh_standby)
        self.state, commands = decide(s, inbox, self.config)
        return self._apply(commands)

    def _gather(self, max_step: int, lost: list[int], standby: list[int]) -> Inbox:
        s, ch, keys = self.state, self.channel, self.keys
        g = keys.gen(s.gen)
        inbox = Inbox(now=time.monotonic(), max_step=max_step, lost_nodes=lost, standby_nodes=standby,
                      deaths=ch.entries(keys.deaths, s.deaths_seen),
                      joiners=ch.entries(keys.joiners, s.joiners_seen),
                      drains=ch.entries(keys.drains, s.drains_seen),
                      nleft=ch.count(g.nleft), nup=ch.count(g.nup), ndone=ch.count(g.ndone))
        if inbox.nleft > len(s.departed):
            for m in s.members:
                if m not in s.departed and (d := ch.read(g.left(m))) is not None:
                    inbox.departures[m] = d
        nodes = [*s.standby_nodes, *standby, *s.nodes]
        if lost or any(inbox.drains) or any(d is not None and d.spare is None for d in inbox.deaths):
            for node in nodes:
                inbox.ready_spares += [(node, w) for w in ch.read(keys.ready_spares(node)) or []]
        if lost or any(inbox.drains):
            inbox.hosted = {node: ch.read(keys.hosted(node)) for node in nodes}
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
