"""The leader's decisions, as a pure function: `decide(state, inbox, config)`.

`decide` takes the planner's state (`planner_state.PlannerState`, a serialisable value: a
later leader can resume it) and an `Inbox` (what the store said since the last look, with the
leader's news of its nodes), and returns the new state and the `Command`s to carry out
(`planner_commands`). No I/O, no clock: each scenario is a table test (tests/unit/test_planner.py).

Node lifecycle comes first (`node_life.py`): standby nodes that arrived, lease silences
(a node silent past `--node-timeout` is lost, or released if it left on purpose), and the
strikes that quarantine a node. Then, while the workers run the resilient loop, the state
machine of one attempt's generations:

    running --(a member died or left)--> broken --(every live member has left)--> forming
    forming --(every member up)--> running           (the recovery is complete)
    running --(a joiner is ready)--> a planned switch at a step boundary (grow back, drain)
    running --(nodes report a stall)--> the culprit (`launch/planning/culprit.py`): its node is
        ordered to kill it, and its death breaks the generation like any other

Every fault, a member's or a replacement's, spends one unit of the job's `RestartBudget`
when it arrives; a fault that finds the budget spent ends the job (`EndAttempt`, give up).
A dead member's slot is refilled by a ready spare (its own node's, promoted at once by its
agent, or another node's, ordered here), else by a replacement this planner orders from the
slot's node. Under `wait` a slot that nothing can refill ends the job at once: nobody waits
out a timeout to learn it. Each death is also a strike against its node.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from unbroken.control.heartbeat_page import LEAVE_NOW
from unbroken.control.messages import (
    Departure,
    DrainRequest,
    Fault,
    FaultKind,
    GenPlan,
    Joiner,
    LeaveReason,
    NodeOrder,
    OrderKind,
    SwitchTarget,
)
from unbroken.errors import ErrorClass
from unbroken.launch.planning import node_life, planner_drains, planner_refills
from unbroken.launch.planning.culprit import take_in_stalls
from unbroken.launch.planning.node_life import Strike
from unbroken.launch.planning.planner_commands import (
    Command,
    EndAction,
    EndAttempt,
    MarkDrained,
    MarkFinished,
    Order,
    Record,
    Say,
    WritePlan,
    WriteTarget,
)
from unbroken.launch.planning.planner_state import (
    Inbox,
    Phase,
    PlannerConfig,
    PlannerState,
    Policy,
    Recovery,
    Refill,
    Stalls,
)
from unbroken.telemetry import schema as ev
from unbroken.telemetry.event_names import Event


# ---------------------------------------------------------------- the decision
def decide(state: PlannerState, inbox: Inbox,
           config: PlannerConfig) -> tuple[PlannerState, list[Command]]:
    """One look: the new state (a copy; its departures, read-only, shared) and what to do,
    up to the first EndAttempt."""
    s = copy.deepcopy(state, {id(d): d for d in state.departed.values()})
    out: list[Command] = []
    _Decision(s, inbox, config, out).run()
    return s, out


class _Decision:
    """One call of `decide`: the state is a private copy, mutated in place."""

    def __init__(self, s: PlannerState, inbox: Inbox, config: PlannerConfig,
                 out: list[Command]) -> None:
        self.s, self.inbox, self.config, self.out = s, inbox, config, out
        self.now = inbox.now

    def end(self, action: EndAction, fault: Fault, reason: str) -> None:
        self.out.append(EndAttempt(action, fault, reason))

    @property
    def ended(self) -> bool:
        return any(isinstance(c, EndAttempt) for c in self.out)

    def record(self, body: ev.EventBody) -> None:
        self.out.append(Record(body))

    def say(self, text: str) -> None:
        self.out.append(Say(text))

    def run(self) -> None:
        self._node_news()
        if self.inbox.in_place and not self.ended:
            self._generations()
        self._strikes()

    def _node_news(self) -> None:
        """Standby arrivals, then lease silences (`node_life`): a newly lost node ends the
        attempt when too few are left (elastic) or when the workers do not recover in
        place; else its ranks go to spares."""
        s, inbox, config = self.s, self.inbox, self.config
        s.seen = replace(s.seen, standbys=s.seen.standbys + len(inbox.standbys))
        for join in filter(None, inbox.standbys):  # None: forged, rejected
            s.nodes = node_life.stand_by(s.nodes, join)
        s.nodes, said, lost = node_life.silences(s.nodes, inbox.silences, inbox.released,
                                                 config.node_timeout, s.attempt)
        if inbox.predecessor is not None and not s.nodes.gone(inbox.predecessor):
            node = inbox.predecessor
            lost[node] = (f"the leader's agent (node {node}) went silent for "
                          f"{config.leader_timeout:g}s")
            s.nodes, more = node_life.declare_lost(s.nodes, node, s.attempt, lost[node])
            said += more
        self.out += said
        if not lost:
            return
        node, detail = next(iter(lost.items()))
        fault = Fault(kind=FaultKind.NODE_LOST, node=node, detail=detail)
        if node_life.below_least(s.nodes, config.least, config.standby_takes_ranks):
            self.say(f"fewer than the --nnodes minimum of {config.least} nodes are left: "
                     "restarting, to wait for nodes")
            return self.end(EndAction.RESTART, fault, detail)
        if not inbox.in_place:
            return self.end(EndAction.RESTART, fault, detail)
        for node in lost:
            self._node_lost(node)
            if self.ended:
                return

    def _strikes(self) -> None:
        """Count each death taken in, and each strike of the inbox, against its node: a
        node with too many is quarantined (`node_life.strike`); it gets no replacement."""
        s, inbox = self.s, self.inbox
        hits = [Strike(d.node, d.t or inbox.wall) for d in inbox.deaths
                if d is not None and d.node is not None and d.kind != FaultKind.NODE_LOST
                and d.error_class != ErrorClass.STOP]  # the job's decision, not the node's fault
        for hit in [*hits, *inbox.strikes]:
            s.nodes, said, quarantined = node_life.strike(s.nodes, hit, self.config.quarantine,
                                                          s.attempt)
            self.out += said
            if quarantined:
                refills = [r for r in s.spares.refills if r.node != hit.node]
                s.spares = replace(s.spares, refills=refills)

    def _generations(self) -> None:
        s, inbox = self.s, self.inbox
        first_drain = s.seen.drains
        s.seen = replace(s.seen, deaths=s.seen.deaths + len(inbox.deaths),
                         joiners=s.seen.joiners + len(inbox.joiners),
                         stalls=s.seen.stalls + len(inbox.stalls),
                         drains=s.seen.drains + len(inbox.drains))
        for death in filter(None, inbox.deaths):
            self._death(death)
            if self.ended:
                return
        for joiner in filter(None, inbox.joiners):
            self._joiner(joiner)
        s.drains, held = planner_drains.taken_up(s.drains, self.config.leader_node)
        new = [(first_drain + i, r) for i, r in enumerate(inbox.drains) if r is not None]
        for index, request in [*held, *new]:  # held: by the last leader, until this one led
            self._drain(index, request)
        s.departed.update({w: d for w, d in inbox.departures.items()
                           if w in s.members and d.gen == s.gen})
        self._step()
        if not self.ended:
            self._stall()
        if not self.ended:
            self.out += planner_refills.order(self.s, self.config, self.now)

    # ------------------------------------------------------------ spares
    def _free_spares(self, avoid: set[int]) -> list[tuple[int, str]]:
        """Ready spares not yet handed out, standby nodes first, none on `avoid` or lost nodes."""
        s = self.s
        barred = set(s.nodes.lost) | set(s.nodes.quarantined) | avoid
        found = [(n, w) for n, w in self.inbox.ready_spares
                 if w not in s.spares.assigned and n not in barred]
        return sorted(found, key=lambda nw: nw[0] not in s.nodes.standby)

    def _assign(self, node: int, spare: str, slot: int) -> str:
        self.s.spares.assigned.append(spare)
        self.s.spares.ordered_from[slot] = node
        self.out.append(Order(node, NodeOrder(OrderKind.PROMOTE, slot=slot, spare=spare)))
        self.record(ev.SpareAssigned(wid=spare, slot=slot, spare_node=node))
        return spare

    # ------------------------------------------------------------ faults
    def _charge(self, fault: Fault) -> bool:
        """Spend one unit of the budget on `fault`; False (and the job ends) if none is left."""
        paid = self.s.budget.spend()
        if paid is not None:
            self.s.budget = paid
            return True
        self.say(f"the restart budget ({self.s.budget.limit}) is spent")
        self.end(EndAction.GIVE_UP, fault,
                 f"the restart budget of {self.s.budget.limit} is spent")
        return False

    def _node_lost(self, node: int) -> None:
        """A lost node's ranks go to ready spares elsewhere, in place; ranks no spare can take
        are dropped under `shrink` (a lost node starts no replacement); under `wait`, or if
        nobody knows what the node ran, the attempt ends for a full restart."""
        s = self.s
        said = self.inbox.hosted.get(node)
        if said is None and node in s.nodes.layout:  # it died before it said: it ran what it started
            said = {f"{slot}.0": slot for slot in s.nodes.layout[node]}
        hosted = {w: slot for w, slot in (said or {}).items()
                  if w in s.members and w not in s.dead}
        detail = f"agent of node {node} silent past --node-timeout"
        if not hosted and (said is not None or node in s.nodes.standby):
            self.say(f"node {node} lost; it ran no rank of the job")
            return
        spares = self._free_spares(avoid={node})
        short = len(spares) < len(hosted)
        if said is None or (short and self.config.policy == Policy.WAIT):
            fault = Fault(kind=FaultKind.NODE_LOST, node=node, attempt=s.attempt, detail=detail)
            self.end(EndAction.RESTART, fault, f"node {node} lost and no spares for its ranks")
            return
        ranks = sorted(hosted.values())
        if not short:
            self.say(f"node {node} lost: its rank(s) {ranks} go to spares in place")
        elif spares:
            self.say(f"node {node} lost: {len(spares)} of its rank(s) {ranks} go to spares, "
                     "the job goes on without the others")
        else:
            self.say(f"node {node} lost: the job goes on without its rank(s) {ranks}")
        taken = iter(spares)
        for wid, slot in sorted(hosted.items(), key=lambda i: i[1]):
            spare = next(taken, None)
            death = Fault(kind=FaultKind.NODE_LOST, node=node, rank=slot, slot=slot, wid=wid,
                          attempt=s.attempt, in_place=True, detail=detail,
                          spare=self._assign(*spare, slot) if spare is not None else None)
            self.record(ev.decode({"event": Event.FAULT, **death.event_fields()}))
            self._death(death)
            if self.ended:
                return
            if spare is None:
                s.spares.refills[:] = [r for r in s.spares.refills if r.slot != slot]

    def _death(self, death: Fault) -> None:
        s = self.s
        if death.attempt is not None and death.attempt != s.attempt:
            return  # a stale message of an older attempt
        if death.wid in s.dead:
            return
        s.dead[death.wid] = death
        member = death.wid in s.members
        if not member:
            # A replacement or promoted spare that died before it joined: its slot is open again.
            s.joiners = [j for j in s.joiners if j != death.wid]
            s.spares.awaited.pop(death.slot, None)
            if s.spares.promised.get(death.slot) == death.wid:
                del s.spares.promised[death.slot]
        if death.error_class == ErrorClass.STOP:  # the job decided to end: not a fault to fix
            self.end(EndAction.GIVE_UP, death, f"rank {death.rank} stopped the job: {death.detail}")
            return
        if not self._charge(death):
            return
        if member and s.recovery is not None and death not in s.recovery.faults:
            s.recovery.faults.append(death)
        if death.spare is None and death.slot is not None:
            spares = self._free_spares(avoid={death.node} if death.node is not None else set())
            if spares:  # its own node had no ready spare: take one from another node
                death.spare = self._assign(*spares[0], death.slot)
        if death.spare is not None:
            s.spares.promised[death.slot] = death.spare
        elif death.slot is not None and death.node is not None \
                and death.node not in s.nodes.lost and death.node not in s.nodes.quarantined \
                and death.node not in s.nodes.standby:
            s.spares.refills.append(Refill(death.slot, death.node, s.gen, self.now))

    def _joiner(self, joiner: Joiner) -> None:
        s = self.s
        if joiner.wid in s.dead:
            return
        s.slot_of[joiner.wid] = joiner.slot
        s.joiners.append(joiner.wid)
        s.spares.awaited.pop(joiner.slot, None)
        if s.spares.promised.get(joiner.slot) == joiner.wid:
            del s.spares.promised[joiner.slot]

    # ------------------------------------------------------------ hangs
    def _stall(self) -> None:
        """Order the culprits of a stall killed (`culprit.take_in_stalls`)."""
        s = self.s
        s.stalls, said, end = take_in_stalls(
            s.stalls, self.inbox.stalls, s.members, s.gen, s.phase == Phase.RUNNING, self.now,
            s.attempt, self.config.stall_limit)
        self.out += said
        if end is not None:
            self.out.append(end)

    # ------------------------------------------------------------ drains
    def _drain(self, index: int, request: DrainRequest) -> None:
        """Have a ready spare promoted into each drained slot; the switch follows its join."""
        s = self.s
        held = planner_drains.hold_for_lead(s, index, request, self.inbox.hosted, self.config)
        if held is not None:
            s.drains = held[0]
            self.out += held[1]
            return
        found = planner_drains.movers(s, request, self.inbox.hosted, self.config)
        if isinstance(found, str):
            self.out += planner_drains.refusal(index, request, found)
            return
        members, node = found
        spares = self._free_spares(avoid={node} if node is not None else set())
        if len(spares) < len(members):
            self.out += planner_drains.refusal(
                index, request, f"{len(members)} rank(s) to move but {len(spares)} ready "
                "spare(s); wait for spares to warm up, or add some")
            return
        moves = {}
        for m, (spare_node, spare) in zip(members, spares, strict=False):
            s.drains.draining[m] = (self._assign(spare_node, spare, s.slot_of[m]), index)
            moves[s.slot_of[m]] = spare
        self.record(ev.DrainStarted(request=request.as_event(), moves=moves))
        self.say(f"draining rank(s) {sorted(moves)} onto spare(s) {list(moves.values())}")

    # ------------------------------------------------------------ the generations
    def _step(self) -> None:
        s, inbox = self.s, self.inbox
        if s.phase in (Phase.RUNNING, Phase.FORMING):
            if any(m in s.dead for m in s.members) or inbox.nleft > 0:
                self._break()
            elif s.phase == Phase.FORMING:
                if inbox.nup >= len(s.members):
                    self._formed()
                elif self.now - s.planned_at > self.config.recovery_timeout:
                    return self._fallback(f"generation {s.gen} did not form within "
                                          f"{self.config.recovery_timeout:g}s")
            # Not an elif: a joiner that registered while this generation formed must be
            # placed now, as the look that saw it up may be the last news for a long time.
            if s.phase == Phase.RUNNING and s.joiners and not s.switch_requested:
                s.switch_requested = True  # grow back (or drain) at a step boundary
                self._request_switch(inbox.max_step + 2)
        if s.phase == Phase.BROKEN:
            return self._settle()
        if s.phase == Phase.RUNNING and not s.finished and inbox.ndone >= len(s.members):
            s.finished = True
            self.out.append(MarkFinished())

    def _request_switch(self, at_step: int) -> None:
        self.s.target = SwitchTarget(gen=self.s.gen + 1, step=at_step)
        self.out.append(WriteTarget(self.s.target))

    def _break(self) -> None:
        s = self.s
        s.phase = Phase.BROKEN
        s.switch_requested = False
        if s.recovery is None:
            s.recovery = Recovery(started=self.now)
        for m in s.members:
            if m in s.dead and s.dead[m] not in s.recovery.faults:
                s.recovery.faults.append(s.dead[m])
        self._request_switch(LEAVE_NOW)  # every member leaves at once (mid-step: aborted)

    def _settle(self) -> None:
        s, config = self.s, self.config
        rec = s.recovery
        left: dict[str, Departure] = {}
        for m in s.members:
            if m in s.dead:
                continue
            record = s.departed.get(m)
            if record is None:
                if self.now - rec.started > config.recovery_timeout:
                    self._fallback(f"worker {m} did not leave generation {s.gen} "
                                   f"within {config.recovery_timeout:g}s")
                return
            left[m] = record
        for m, r in left.items():
            if r.reason != LeaveReason.EXCEPTION:
                continue
            fault = Fault(kind=FaultKind.EXCEPTION, rank=s.slot_of[m], wid=m, slot=s.slot_of[m],
                          step=r.step, detail=r.error or "", traceback=r.traceback,
                          attempt=s.attempt, in_place=True)
            if any(f.wid == m and f.kind == FaultKind.EXCEPTION for f in rec.faults):
                continue
            rec.faults.append(fault)
            self.record(ev.decode({"event": Event.FAULT, **fault.event_fields()}))
            self.say(f"fault: rank {fault.rank} exception: {fault.detail} (recovering in place)")
            if not self._charge(fault):
                return
        if any(r.reason == LeaveReason.NO_STATE for r in left.values()):
            why = next((r.error for r in left.values()
                        if r.reason == LeaveReason.NO_STATE and r.error), None)
            return self._fallback(why or "no live worker holds the committed state")
        if not any(r.holds_state for r in left.values()):
            return self._fallback("every worker that held the committed state is gone")
        if rec.held is None:
            rec.held = max(r.step for r in left.values())
            again, s.last_held = rec.held == s.last_held, rec.held
            if again and any(f.kind == FaultKind.EXCEPTION for f in rec.faults):
                # An exception that recurs at once in place would spend the whole budget in a
                # second (a framework that counted the old world); a death is another fault.
                why = (f"a second fault at step {rec.held} before any step was committed "
                       "since the last recovery in place: restarting every worker")
                self.say(why)
                return self.end(EndAction.RESTART, rec.faults[-1], why)
        members = list(left)
        missing = {s.slot_of[m] for m in s.members if m in s.dead}
        ready = [j for j in s.joiners if j not in members]
        filled = {s.slot_of[j] for j in ready}
        # A slot a hot spare was promoted into is worth waiting for under any policy: the
        # spare is warm and joins in milliseconds, and the world size stays as it was.
        if set(s.spares.promised) - filled and self.now - rec.started < config.spare_wait:
            return
        # Sharded state cannot shrink in place (it would need resharding), nor can a job
        # whose framework fixed the world size (its sampler, step count and the process
        # count that Accelerate and Lightning cache): such a job always waits for its lost
        # ranks' spares or replacements, whatever --on-fault says.
        policy, fixed = planner_refills.policy(s, left.values(), config)
        if policy == Policy.WAIT and missing - filled:
            hopeless = planner_refills.hopeless(s, missing - filled)
            if hopeless:
                fault = next(s.dead[m] for m in s.members
                             if m in s.dead and s.slot_of[m] == hopeless[0])
                why = (f"rank(s) {hopeless} cannot be refilled in place (no ready spare, and "
                       "no node to start a replacement): restarting every worker")
                self.say(why)
                return self.end(EndAction.RESTART, fault, why)
            if self.now - rec.started < config.join_timeout:
                self.out += planner_refills.waiting(rec, fixed, missing - filled, config)
                return  # wait for the replacements to take the failed slots
            if s.fixed_world:  # a framework's world is never shrunk
                return self._fallback(f"rank(s) {sorted(missing - filled)} not refilled in time")
        # A drained member gives its slot to its spare once the spare is here; it left
        # holding the state like everyone else, and is told to exit, not that it failed.
        draining = s.drains.draining
        drained = [m for m in members if m in draining and draining[m][0] in ready]
        for m in drained:
            self.out.append(MarkDrained(m))
            spare, index = draining.pop(m)
            s.drains.moved.append((m, spare, index))
        members = [m for m in members if m not in drained] + ready
        s.joiners = [j for j in s.joiners if j not in members]
        self._plan(sorted(members, key=lambda m: s.slot_of[m]))

    def _plan(self, members: list[str]) -> None:
        s = self.s
        gen = s.gen + 1
        self.out.append(WritePlan(GenPlan(gen=gen, members=members)))
        self.record(ev.GenPlan(gen=gen, world_size=len(members), members=members,
                               duration=round(self.now - s.recovery.started, 6)
                               if s.recovery else None))
        s.gen, s.members = gen, members
        s.departed = {}
        s.stalls = Stalls()
        # A promised spare not in this plan may still join later (it is then awaited like a
        # replacement); it is no reason to wait `spare_wait` in the next recovery.
        for slot, spare in list(s.spares.promised.items()):
            if spare not in members:
                s.spares.awaited[slot] = self.now
                del s.spares.promised[slot]
        s.phase = Phase.FORMING
        s.planned_at = self.now

    def _formed(self) -> None:
        s = self.s
        s.phase = Phase.RUNNING
        rec = s.recovery
        self.record(ev.GenUp(gen=s.gen, world_size=len(s.members),
                             duration=round(self.now - rec.started, 6) if rec else None,
                             faults=[f.kind.value for f in rec.faults] if rec else []))
        if rec and rec.faults:
            s.recovered += len(rec.faults)
            self.say(f"recovered in place: generation {s.gen} of {len(s.members)} workers "
                     f"up {self.now - rec.started:.3f}s after the fault")
        s.recovery = None
        switch_s = round(self.now - rec.started, 6) if rec else None
        s.drains, said = planner_drains.answered(s.drains, s.slot_of, s.gen, switch_s)
        self.out += said

    def _fallback(self, why: str) -> None:
        """Restart every worker from the checkpoint. Paid for by the recovery's faults; a
        recovery with none (members left on peer errors, a switch that did not form) is a
        fault of its own, which the leader charges (`RESTART`)."""
        s = self.s
        paid = bool(s.recovery and s.recovery.faults)
        fault = copy.copy(s.recovery.faults[0] if paid
                          else Fault(kind=FaultKind.RECOVERY_FAILED, attempt=s.attempt))
        fault.detail = f"{fault.detail} ({why})".strip()
        self.record(ev.RecoveryFallback(gen=s.gen, reason=why))
        self.say(f"in-place recovery impossible ({why}): restarting every worker")
        self.end(EndAction.FALLBACK if paid else EndAction.RESTART, fault, why)
