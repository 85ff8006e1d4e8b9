"""The worker's side of the generation protocol, spoken through the control channel.

A generation is a membership (an ordered list of worker ids) plus the process groups built on
it. The leader agent alone writes plans; workers leave a generation, wait for the next plan
that names them, meet the other members, and report themselves up. The keys are declared in
`unbroken.control.schema` (`AttemptKeys`, `GenKeys`); the sequence is in
docs/design-notes.md ("The control protocol").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed import Store

from unbroken.control.channel import Channel
from unbroken.control.messages import Departure, GenPlan, Joiner, LeaveReason, NodeDepartures
from unbroken.control.schema import AttemptKeys
from unbroken.polling import poll_until


@dataclass(frozen=True)
class Plan:
    gen: int
    members: list[str]
    rank: int  # this worker's rank in the generation

    @property
    def world_size(self) -> int:
        return len(self.members)


class Excluded(RuntimeError):
    """The leader planned a generation without this worker (it was presumed dead or stuck)."""


class Drained(Exception):
    """A drain moved this worker's rank onto a spare: it is done, and exits cleanly."""


class JobFinished(Exception):
    """The job finished while this worker waited to join."""


class RecoveryTimeout(RuntimeError):
    """No plan came within the bound: the leader is gone or has given up on recovery."""


class Membership:
    """One worker's membership calls; every wait is bounded by `timeout`."""

    def __init__(self, channel: Channel, attempt: int, wid: str,
                 on_wait: Callable[[], None], timeout: float, poll: float = 0.001,
                 node: int = 0, post: Callable[[int, Departure], bool] | None = None) -> None:
        self.channel = channel
        self.attempt = attempt
        self.keys = AttemptKeys(attempt)
        self.wid = wid
        self.node = node
        # Hands a departure to this node's agent, which gathers the node's into one write
        # (`control/departure_post.py`); False, or None: the worker writes its own.
        self._post = post
        self._on_wait = on_wait  # keeps the heartbeat fresh while we wait
        self.timeout = timeout
        self.poll = poll

    def latest(self) -> int:
        """The newest planned generation (0 before any recovery)."""
        return self.channel.read(self.keys.latest_gen) or 0

    def leave(self, gen: int, step: int, holds_state: bool, reason: LeaveReason,
              error: str | None = None, traceback: str | None = None,
              sharded: bool = False, fixed_world: str | None = None) -> None:
        departure = Departure(
            wid=self.wid, gen=gen, step=step, holds_state=holds_state, reason=LeaveReason(reason),
            t=time.time(), error=error, traceback=traceback, sharded=sharded,
            fixed_world=fixed_world)
        if self._post is not None and self._post(self.attempt, departure):
            return
        self.channel.append(self.keys.gen(gen).departures,
                            NodeDepartures(node=self.node, departures=[departure]))

    def register_joiner(self, slot: int) -> None:
        self.channel.append(self.keys.joiners, Joiner(wid=self.wid, slot=slot))

    def finished(self) -> bool:
        """The job finished: a joiner or spare still waiting goes home."""
        return bool(self.channel.read(self.keys.finished))

    def await_finished(self) -> None:
        """Wait (bounded by the recovery timeout) for the job to end or the agent to stop
        us: after a switch that cannot succeed, the leader restarts every worker."""
        self._poll(lambda: True if self.finished() else None, "the leader's fallback")

    def _poll(self, ready: Callable[[], Any], what: str) -> Any:
        """Poll until `ready()` returns something other than None, keeping the heartbeat fresh."""
        return poll_until(ready, self.timeout, self.poll, on_wait=lambda _: self._on_wait(),
                          timeout_error=lambda: RecoveryTimeout(f"{what} within {self.timeout:g}s"))

    def next_plan(self, after: int, joining: bool = False) -> Plan:
        """Block until a generation newer than `after` names this worker.

        A member left out of a plan is excluded; a joiner keeps waiting for one that names it.
        """
        seen = after

        def named() -> Plan | None:
            nonlocal seen
            latest = self.latest()
            if latest > seen:
                plan: GenPlan = self.channel.read(self.keys.gen(latest).plan)
                seen = latest
                if self.wid in plan.members:
                    return Plan(latest, plan.members, plan.members.index(self.wid))
                if not joining:
                    if self.channel.read(self.keys.drained(self.wid)):
                        raise Drained
                    raise Excluded(f"generation {latest} was planned without worker {self.wid}")
            if self.finished():
                raise JobFinished
            return None

        return self._poll(named, f"no generation after {after} named worker {self.wid}")

    def gather(self, plan: Plan) -> bool:
        """Barrier before forming groups; False if a newer generation superseded `plan`."""
        nready = self.keys.gen(plan.gen).nready
        self.channel.bump(nready)

        def arrived() -> bool | None:
            if self.channel.count(nready) >= plan.world_size:
                return True
            target = self.channel.read(self.keys.target)
            superseded = self.latest() > plan.gen or (target is not None and target.gen > plan.gen)
            return False if superseded else None

        return self._poll(arrived, f"members of generation {plan.gen} did not all arrive")

    def store_for(self, plan: Plan, timeout: float) -> Store:
        """Where the generation's process groups rendezvous: a fresh prefix of its own, over
        a connection of its own. A rendezvous that times out (a member died while joining)
        can leave a store client out of step with the server, so no client outlives its
        generation."""
        return self.channel.backend.rendezvous_store(self.keys.gen(plan.gen).rendezvous_prefix,
                                                     timeout)

    def report_up(self, plan: Plan) -> None:
        self.channel.bump(self.keys.gen(plan.gen).nup)

    def report_done(self, gen: int) -> None:
        self.channel.bump(self.keys.gen(gen).ndone)
