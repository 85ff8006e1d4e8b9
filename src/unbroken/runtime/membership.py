"""The worker's side of the generation protocol, spoken through the control store.

A generation is a membership (an ordered list of worker ids) plus the process groups built on
it. The leader agent alone writes plans; workers leave a generation, wait for the next plan
that names them, meet the other members, and report themselves up. Keys, under the run's
prefix (`unbroken/<run_id>/a/<attempt>/`):

    gen                   the newest planned generation (written after its plan)
    g/<G>/plan            {"gen", "members": [worker id, ...]}; rank = index in members
    g/<G>/left/<wid>      why and with what state a member left G; g/<G>/nleft counts them
    g/<G>/nready          members that reached G's rendezvous (a barrier before forming groups)
    g/<G>/nup             members that finished the switch (groups, state, model rebuilt)
    g/<G>/pg/...          the store prefix G's process groups rendezvous under
    g/<G>/ndone           members that finished training in G
    joiners, joiner/<i>   replacement workers waiting to be placed
    news                  bumped with every write the leader must act on, so that an idle
                          leader polls one key
    drained/<wid>         a drain moved this member's rank onto a spare: it exits cleanly
    finished              the job is done: waiting joiners go home
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed import PrefixStore, Store

from unbroken.launch.control_store import ControlStore


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
    def __init__(self, ctl: ControlStore, attempt: int, wid: str,
                 on_wait: Callable[[], None], timeout: float,
                 connect: Callable[[float], Store], poll: float = 0.001) -> None:
        self.ctl = ctl
        self._connect = connect  # a new client connection to the control store
        self.wid = wid
        self.prefix = f"a/{attempt}/"
        self._on_wait = on_wait  # keeps the heartbeat fresh while we wait
        self.timeout = timeout
        self.poll = poll

    def _key(self, key: str) -> str:
        return self.prefix + key

    def latest(self) -> int:
        """The newest planned generation (0 before any recovery)."""
        return self.ctl.get_json(self._key("gen")) or 0

    def leave(self, gen: int, step: int, holds_state: bool, reason: str, **detail: Any) -> None:
        record = {"wid": self.wid, "step": step, "holds_state": holds_state, "reason": reason,
                  "t": time.time(), **detail}
        self.ctl.set_json(self._key(f"g/{gen}/left/{self.wid}"), record)
        self.ctl.add(self._key(f"g/{gen}/nleft"), 1)
        self.ctl.add(self._key("news"), 1)

    def register_joiner(self, slot: int) -> None:
        index = self.ctl.add(self._key("joiners"), 1) - 1
        self.ctl.set_json(self._key(f"joiner/{index}"), {"wid": self.wid, "slot": slot})
        self.ctl.add(self._key("news"), 1)

    def _poll(self, ready: Callable[[], Any], what: str) -> Any:
        """Poll until `ready()` returns something other than None, keeping the heartbeat fresh."""
        deadline = time.monotonic() + self.timeout
        while (result := ready()) is None:
            if time.monotonic() > deadline:
                raise RecoveryTimeout(f"{what} within {self.timeout:g}s")
            self._on_wait()
            time.sleep(self.poll)
        return result

    def next_plan(self, after: int, joining: bool = False) -> Plan:
        """Block until a generation newer than `after` names this worker.

        A member left out of a plan is excluded; a joiner keeps waiting for one that names it.
        """
        seen = after

        def named() -> Plan | None:
            nonlocal seen
            latest = self.latest()
            if latest > seen:
                plan = self.ctl.get_json(self._key(f"g/{latest}/plan"))
                seen = latest
                if self.wid in plan["members"]:
                    return Plan(latest, plan["members"], plan["members"].index(self.wid))
                if not joining:
                    if self.ctl.get_json(self._key(f"drained/{self.wid}")):
                        raise Drained
                    raise Excluded(f"generation {latest} was planned without worker {self.wid}")
            if self.ctl.get_json(self._key("finished")):
                raise JobFinished
            return None

        return self._poll(named, f"no generation after {after} named worker {self.wid}")

    def gather(self, plan: Plan) -> bool:
        """Barrier before forming groups; False if a newer generation superseded `plan`."""
        self.ctl.add(self._key(f"g/{plan.gen}/nready"), 1)

        def arrived() -> bool | None:
            if self.ctl.add(self._key(f"g/{plan.gen}/nready"), 0) >= plan.world_size:
                return True
            target = self.ctl.get_json(self._key("target")) or {}
            superseded = self.latest() > plan.gen or target.get("gen", 0) > plan.gen
            return False if superseded else None

        return self._poll(arrived, f"members of generation {plan.gen} did not all arrive")

    def store_for(self, plan: Plan, timeout: float) -> Store:
        """Where the generation's process groups rendezvous: a fresh prefix of its own, over
        a connection of its own. A rendezvous that times out (a member died while joining)
        can leave a store client out of step with the server, so no client outlives its
        generation."""
        return PrefixStore(f"{self.ctl.prefix}{self.prefix}g/{plan.gen}/pg/", self._connect(timeout))

    def report_up(self, plan: Plan) -> None:
        self.ctl.add(self._key(f"g/{plan.gen}/nup"), 1)
        self.ctl.add(self._key("news"), 1)

    def report_done(self, gen: int) -> None:
        self.ctl.add(self._key(f"g/{gen}/ndone"), 1)
        self.ctl.add(self._key("news"), 1)
