"""The leader's side of in-place recovery: it alone decides each generation's membership.

Every agent publishes the deaths of its workers; workers publish when they leave a
generation and when they are up in a new one; replacements register as joiners. Each tick,
the leader reads those and moves one state machine:

    running --(a member died or left)--> broken --(every live member has left)--> forming
    forming --(every member up)--> running           (the recovery is complete)
    running --(a joiner is ready, shrink policy)--> a planned switch at a step boundary

A drain (`unbroken drain`) is a planned move: the leader has a ready spare promoted into
each drained slot, and once the spare has registered, every member leaves at a step boundary
and the next plan names the spare instead of the drained worker, which then exits cleanly.

A plan lists the members by logical slot (a worker's original rank, which a replacement
inherits), so when every slot is filled again the layout is exactly the original one. When
in-place recovery is impossible (no live member holds committed state) or does not complete
within the recovery timeout, the tick returns a fallback: the agent restarts everything from
the last checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unbroken.launch.control_store import ControlStore
from unbroken.launch.spare_board import SpareBroker

SHRINK, WAIT = "shrink", "wait"
SPARE_WAIT = 5.0  # seconds to wait for a promoted spare before planning without it


@dataclass
class Verdict:
    """What the agent must do now: "fallback" (full restart) or "give_up" (budget spent)."""

    action: str
    fault: dict[str, Any]


@dataclass
class _Recovery:
    started: float  # monotonic, when the generation broke
    wall: float  # time.time() of the same moment
    faults: list[dict[str, Any]] = field(default_factory=list)


class GenerationPlanner:
    def __init__(self, ctl: ControlStore, attempt: int, slots: dict[str, int], policy: str,
                 recovery_timeout: float, join_timeout: float, budget: int,
                 record: Callable[..., None], say: Callable[[str], None],
                 broker: SpareBroker | None = None) -> None:
        self.ctl = ctl
        self.prefix = f"a/{attempt}/"
        self.attempt = attempt
        self.policy = policy
        self.recovery_timeout = recovery_timeout
        self.join_timeout = join_timeout
        self.budget = budget  # faults we may still recover from
        self.record = record
        self.say = say
        self.slot_of = dict(slots)
        # Ready spares of every node, for a death whose own node has none, and for drains.
        self.broker = broker
        self.draining: dict[str, tuple[str, int]] = {}  # member -> (its spare, drain index)
        self._drains_seen = 0
        self._moved: list[tuple[str, str, int]] = []  # (member, spare, drain index) this switch
        self._moves: dict[int, list[dict[str, Any]]] = {}  # drain index -> ranks moved so far
        self.gen = 0
        self.members = sorted(slots, key=slots.get)
        self.state = "running"
        self.recovery: _Recovery | None = None
        self.planned_at = 0.0
        self.dead: dict[str, dict[str, Any]] = {}
        self.joiners: list[str] = []
        self.recovered = 0  # faults recovered in place
        self._deaths_seen = 0
        self._joiners_seen = 0
        self._switch_requested = False
        self.target: dict[str, int] | None = None  # the switch request workers must see
        self._news = -1

    # ------------------------------------------------------------------ store
    def _get(self, key: str) -> Any:
        return self.ctl.get_json(self.prefix + key)

    def _count(self, key: str) -> int:
        return self.ctl.add(self.prefix + key, 0)

    @property
    def busy(self) -> bool:
        """A recovery or switch is in progress: the agent should tick fast."""
        return self.state != "running" or self._switch_requested

    def _read_news(self) -> None:
        deaths = self._count("deaths")
        for i in range(self._deaths_seen, deaths):
            death = self._get(f"death/{i}")
            if death is None:
                self._news = -1  # counted but not yet written; read it next tick
                return
            if ("spare" not in death and self.broker is not None
                    and death["wid"] in self.members and death["wid"] not in self.dead):
                # Its own node had no ready spare: take one from another node.
                found = self.broker.ready(avoid={death.get("node")})
                if found:
                    death = {**death, "spare": self._assign(*found[0], death["slot"])}
            self.dead[death["wid"]] = death
            self._deaths_seen = i + 1
        joiners = self._count("joiners")
        for i in range(self._joiners_seen, joiners):
            joiner = self._get(f"joiner/{i}")
            if joiner is None:
                self._news = -1
                return
            self.slot_of[joiner["wid"]] = joiner["slot"]
            self.joiners.append(joiner["wid"])
            self._joiners_seen = i + 1
        self.joiners = [w for w in self.joiners if w not in self.dead]
        drains = self._count("drains")
        for i in range(self._drains_seen, drains):
            request = self._get(f"drain/{i}")
            if request is None:
                self._news = -1
                return
            self._drains_seen = i + 1
            self._drain(i, request)

    def _drain(self, index: int, request: dict[str, Any]) -> None:
        """Have a ready spare promoted into each drained slot; the switch follows its join."""
        def refuse(why: str) -> None:
            self.ctl.set_json(f"{self.prefix}drain/{index}/outcome", {"ok": False, "error": why})
            self.record("drain_refused", request=request, reason=why)
            self.say(f"drain refused: {why}")

        if self.state != "running" or self._switch_requested:
            return refuse("a recovery or switch is in progress; try again in a moment")
        if "node" in request:
            node = int(request["node"])
            if node == 0:
                return refuse("node 0 hosts the control store and cannot be drained")
            hosted = self.broker.hosted(node) if self.broker is not None else {}
            movers = [m for m in self.members if m in hosted]
        else:
            movers = [m for m in self.members if self.slot_of[m] == int(request["slot"])]
            node = None
        if not movers:
            return refuse(f"no member of generation {self.gen} is on "
                          + (f"node {node}" if node is not None else f"rank {request['slot']}"))
        if len(movers) >= len(self.members):
            return refuse("a drain needs a member that stays to hand the state over")
        if self.broker is None:
            return refuse("no spares: start the job with --spares N or add a --standby node")
        found = self.broker.ready(avoid={node} if node is not None else set())
        if len(found) < len(movers):
            return refuse(f"{len(movers)} rank(s) to move but {len(found)} ready spare(s); "
                          "wait for spares to warm up, or add some")
        moves = {}
        for m, (spare_node, spare) in zip(movers, found, strict=False):
            self.draining[m] = (self._assign(spare_node, spare, self.slot_of[m]), index)
            moves[self.slot_of[m]] = spare
        self.record("drain_started", request=request, moves=moves)
        self.say(f"draining rank(s) {sorted(moves)} onto spare(s) {list(moves.values())}")

    def _assign(self, node: int, spare: str, slot: int) -> str:
        self.broker.assign(node, spare, slot)
        self.record("spare_assigned", wid=spare, slot=slot, spare_node=node)
        return spare

    def _request_switch(self, at_step: int) -> None:
        self.target = {"gen": self.gen + 1, "step": at_step}
        self.ctl.set_json(self.prefix + "target", self.target)

    # ------------------------------------------------------------------ tick
    def tick(self, max_step: Callable[[], int]) -> Verdict | None:
        """One look at the news; `max_step()` is the furthest step a member has reached."""
        news = self._count("news")
        if news == self._news and not self.busy:
            return None  # nothing happened: one store read per tick in steady state
        self._news = news
        self._read_news()
        now = time.monotonic()
        if self.state in ("running", "forming"):
            dead_members = [m for m in self.members if m in self.dead]
            if dead_members or self._count(f"g/{self.gen}/nleft") > 0:
                self._break(now)
            elif self.state == "forming":
                if self._count(f"g/{self.gen}/nup") >= len(self.members):
                    self._formed(now)
                elif now - self.planned_at > self.recovery_timeout:
                    return self._fallback(f"generation {self.gen} did not form within "
                                          f"{self.recovery_timeout:g}s")
            # Not an elif: a joiner that registered while this generation formed must be
            # placed now, as the tick that saw it up may be the last news for a long time.
            if self.state == "running" and self.joiners and not self._switch_requested:
                # A replacement is ready (under "wait", one that came after the wait timed
                # out and the job shrank): grow back at a step boundary.
                self._switch_requested = True
                self._request_switch(max_step() + 2)
        if self.state == "broken":
            return self._settle(now)
        if self.state == "running" and self._count(f"g/{self.gen}/ndone") >= len(self.members):
            self.ctl.set_json(self.prefix + "finished", True)
        return None

    def _break(self, now: float) -> None:
        self.state = "broken"
        self._switch_requested = False
        if self.recovery is None:
            self.recovery = _Recovery(started=now, wall=time.time())
        self._request_switch(0)  # every member leaves at its next step boundary

    def _settle(self, now: float) -> Verdict | None:
        left = {}
        for m in self.members:
            if m not in self.dead:
                record = self._get(f"g/{self.gen}/left/{m}")
                if record is None:
                    if now - self.recovery.started > self.recovery_timeout:
                        return self._fallback(f"worker {m} did not leave generation {self.gen} "
                                              f"within {self.recovery_timeout:g}s")
                    return None
                left[m] = record
        faults = [self.dead[m] for m in self.members if m in self.dead]
        faults += [{"kind": "exception", "rank": self.slot_of[m], "wid": m,
                    "slot": self.slot_of[m], "step": r["step"], "detail": r.get("error"),
                    "traceback": r.get("traceback")}
                   for m, r in left.items() if r["reason"] == "exception"]
        for fault in faults:
            if fault not in self.recovery.faults:
                self.recovery.faults.append(fault)
                if fault["kind"] == "exception":  # deaths were recorded by their agents
                    self.record("fault", **fault, in_place=True)
                    self.say(f"fault: rank {fault['rank']} exception: {fault['detail']} "
                             "(recovering in place)")
                if self.budget <= 0:
                    return Verdict("give_up", fault)
                self.budget -= 1
        if any(r["reason"] == "no_state" for r in left.values()):
            return self._fallback("no live worker holds the committed state")
        holders = [m for m, r in left.items() if r["holds_state"]]
        if not holders:
            return self._fallback("every worker that held the committed state is gone")
        members = list(left)
        missing = {self.slot_of[m] for m in self.members if m in self.dead}
        ready = [j for j in self.joiners if j not in members]
        filled = {self.slot_of[j] for j in ready}
        # A slot a hot spare was promoted into is worth waiting for under any policy: the
        # spare is warm and joins in milliseconds, and the world size stays as it was.
        promised = {self.slot_of[m] for m in self.members if self.dead.get(m, {}).get("spare")}
        if promised - filled and now - self.recovery.started < SPARE_WAIT:
            return None
        if self.policy == WAIT and missing - filled:
            if now - self.recovery.started < self.join_timeout:
                return None  # wait for the replacements to take the failed slots
        # A drained member gives its slot to its spare once the spare is here; it left
        # holding the state like everyone else, and is told to exit, not that it failed.
        drained = [m for m in members
                   if m in self.draining and self.draining[m][0] in ready]
        for m in drained:
            self.ctl.set_json(f"{self.prefix}drained/{m}", True)
            self._moved.append((m, *self.draining.pop(m)))
        members = [m for m in members if m not in drained] + ready
        self.joiners = [j for j in self.joiners if j not in members]
        self._plan(sorted(members, key=lambda m: self.slot_of[m]), now)
        return None

    def _plan(self, members: list[str], now: float) -> None:
        gen = self.gen + 1
        plan = {"gen": gen, "members": members}
        self.ctl.set_json(f"{self.prefix}g/{gen}/plan", plan)
        self.ctl.set_json(self.prefix + "gen", gen)
        self.record("gen_plan", gen=gen, world_size=len(members), members=members,
                    duration=round(now - self.recovery.started, 6) if self.recovery else None)
        self.gen, self.members = gen, members
        self.state = "forming"
        self.planned_at = now

    def _formed(self, now: float) -> None:
        self.state = "running"
        rec = self.recovery
        self.record("gen_up", gen=self.gen, world_size=len(self.members),
                    duration=round(now - rec.started, 6) if rec else None,
                    faults=[f.get("kind") for f in rec.faults] if rec else [])
        if rec and rec.faults:
            self.recovered += len(rec.faults)
            self.say(f"recovered in place: generation {self.gen} of {len(self.members)} workers "
                     f"up {now - rec.started:.3f}s after the fault")
        self.recovery = None
        switch_s = round(now - rec.started, 6) if rec else None
        for member, spare, index in self._moved:
            move = {"rank": self.slot_of[spare], "from": member, "to": spare}
            self._moves.setdefault(index, []).append(move)
            self.record("drained", **move, gen=self.gen, switch_s=switch_s)
            self.say(f"drained rank {move['rank']}: {member} -> {spare}, generation {self.gen} "
                     f"up {switch_s}s after the switch began")
        for index in {index for _, _, index in self._moved}:
            if not any(i == index for _, i in self.draining.values()):  # every rank moved
                self.ctl.set_json(f"{self.prefix}drain/{index}/outcome", {
                    "ok": True, "moves": self._moves.pop(index), "gen": self.gen, "switch_s": switch_s})
        self._moved = []

    def _fallback(self, why: str) -> Verdict:
        fault = (self.recovery.faults[0] if self.recovery and self.recovery.faults
                 else {"kind": "recovery_failed", "rank": None})
        self.record("recovery_fallback", gen=self.gen, reason=why)
        self.say(f"in-place recovery impossible ({why}): restarting every worker")
        return Verdict("fallback", {**fault, "detail": f"{fault.get('detail', '')} ({why})".strip()})
