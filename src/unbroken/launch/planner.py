"""The leader's decisions about generations, as a pure function: `decide(state, inbox)`.

`decide` takes the planner's state (a serialisable value: a later leader can resume it) and
an `Inbox` (what the store said since the last look, read by `plan_executor`), and returns
the new state and the `Command`s to carry out. It does no I/O and reads no clock, so every
scenario is a table test (tests/unit/test_planner.py).

The state machine of one attempt's generations:

    running --(a member died or left)--> broken --(every live member has left)--> forming
    forming --(every member up)--> running           (the recovery is complete)
    running --(a joiner is ready)--> a planned switch at a step boundary (grow back, drain)
    running --(nodes report a stall)--> blame (`launch/blame.py`): the culprit's node is
        ordered to kill it, and its death breaks the generation like any other

Every fault, a member's or a replacement's, spends one unit of the job's `RestartBudget`
when it arrives; a fault that finds the budget spent ends the job (`EndAttempt`, give up).
A dead member's slot is refilled by a ready spare (its own node's, promoted at once by its
agent, or another node's, ordered here), else by a replacement this planner orders from the
slot's node. Under `wait` a slot that nothing can refill ends the job at once: nobody waits
out a timeout to learn it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from unbroken.control.messages import (
    Departure,
    DrainKind,
    DrainOutcome,
    DrainRequest,
    Fault,
    FaultKind,
    GenPlan,
    Joiner,
    LeaveReason,
    NodeOrder,
    OrderKind,
    StallReport,
    SwitchTarget,
)
from unbroken.launch.blame import VerdictKind, blame
from unbroken.launch.budget import RestartBudget
from unbroken.runtime.heartbeat import LEAVE_NOW
from unbroken.telemetry.event_names import Event


class Policy(StrEnum):
    """What survivors do about a slot with no ready spare."""

    SHRINK = "shrink"  # go on without it; the replacement joins at a step boundary
    WAIT = "wait"  # wait for the replacement (up to `join_timeout`, then shrink)


class Phase(StrEnum):
    RUNNING = "running"
    BROKEN = "broken"  # members are leaving the generation
    FORMING = "forming"  # the next generation is planned; its members are switching


@dataclass(frozen=True)
class PlannerConfig:
    policy: Policy = Policy.SHRINK
    recovery_timeout: float = 30.0
    """A generation that does not form within this falls back to a full restart."""
    join_timeout: float = 60.0
    """`wait`: how long survivors wait for a replacement, then shrink."""
    spare_wait: float = 5.0
    """How long a promised spare is waited for, under any policy, before planning without it."""
    replacement_delay: float = 2.0
    """`shrink`: a replacement is ordered once survivors run the next generation, or by then."""
    stall_limit: float = 60.0  # the leader makes it at least 3 x --node-timeout
    """A stall nobody can be blamed for (a member unreported and not lost, or every member
    alive at the same point: a network blip, a stuck file system) that lasts this long
    ends the attempt for a full restart."""


@dataclass
class Recovery:
    started: float  # when the generation broke
    faults: list[Fault] = field(default_factory=list)


@dataclass
class Refill:
    """A slot whose replacement is to be ordered from `node` (not yet: see `_order_refills`)."""

    slot: int
    node: int
    broke_gen: int  # the generation the death broke
    since: float


@dataclass
class PlannerState:
    """Everything the planner knows; serialisable with `control.codec`."""

    attempt: int
    budget: RestartBudget
    members: list[str]  # the current generation's, in rank order
    slot_of: dict[str, int]  # worker id -> logical slot
    nodes: list[int]  # the attempt's planned nodes
    layout: dict[int, list[int]] = field(default_factory=dict)  # node -> its slots at the start
    gen: int = 0
    phase: Phase = Phase.RUNNING
    recovery: Recovery | None = None
    planned_at: float = 0.0
    dead: dict[str, Fault] = field(default_factory=dict)
    joiners: list[str] = field(default_factory=list)  # registered, not yet members
    departed: dict[str, Departure] = field(default_factory=dict)  # left the current generation
    promised: dict[int, str] = field(default_factory=dict)  # slot -> spare promoted into it
    awaited: dict[int, float] = field(default_factory=dict)  # slot -> when its replacement was ordered
    refills: list[Refill] = field(default_factory=list)
    draining: dict[str, tuple[str, int]] = field(default_factory=dict)  # member -> (spare, drain)
    moved: list[tuple[str, str, int]] = field(default_factory=list)  # this switch's drains
    moves: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # drain -> moves so far
    assigned: list[str] = field(default_factory=list)  # spares handed out
    standby_nodes: list[int] = field(default_factory=list)
    lost_nodes: list[int] = field(default_factory=list)
    barred_nodes: list[int] = field(default_factory=list)  # quarantined: no spare, no replacement
    switch_requested: bool = False
    target: SwitchTarget | None = None
    # Stalls of the current generation: each node's latest report, when the first came,
    # the members already blamed (ordered killed), and the last verdict recorded.
    stalls: dict[int, StallReport] = field(default_factory=dict)
    stall_since: float | None = None
    blamed: list[str] = field(default_factory=list)
    stall_verdict: str | None = None
    recovered: int = 0  # faults recovered in place
    finished: bool = False
    # Inbox cursors: entries of each queue already taken in.
    deaths_seen: int = 0
    joiners_seen: int = 0
    drains_seen: int = 0
    stalls_seen: int = 0

    @property
    def busy(self) -> bool:
        """A recovery, switch or refill is under way: look again soon."""
        return self.phase != Phase.RUNNING or self.switch_requested or bool(self.refills)


def initial_state(attempt: int, world_size: int, nodes: list[int] | dict[int, list[int]],
                  budget: RestartBudget) -> PlannerState:
    """Generation 0 of an attempt: every slot's first worker. `nodes` maps each node to the
    slots it starts with (or lists the nodes, when no layout is known)."""
    slots = {f"{r}.0": r for r in range(world_size)}
    layout = dict(nodes) if isinstance(nodes, dict) else {}
    return PlannerState(attempt=attempt, budget=budget, members=list(slots), slot_of=slots,
                        nodes=list(nodes), layout=layout)


def rebase(state: PlannerState, shift: float) -> PlannerState:
    """The state with every monotonic time moved by `shift` seconds: how a successor on
    another host (another monotonic clock) resumes a persisted state. Deadlines keep the
    time they had left when the state was written, plus the time it lay in the store."""
    s = copy.deepcopy(state)
    s.planned_at += shift
    s.awaited = {slot: t + shift for slot, t in s.awaited.items()}
    for refill in s.refills:
        refill.since += shift
    if s.recovery is not None:
        s.recovery.started += shift
    if s.stall_since is not None:
        s.stall_since += shift
    return s


@dataclass
class Inbox:
    """What the store said since the last look (read by the executor)."""

    now: float  # seconds, monotonic (the leader's clock)
    max_step: int = 0  # the furthest step a member has reached
    # New entries of the queues; None stands for a forged entry (rejected, reported).
    deaths: list[Fault | None] = field(default_factory=list)
    joiners: list[Joiner | None] = field(default_factory=list)
    drains: list[DrainRequest | None] = field(default_factory=list)
    stalls: list[StallReport | None] = field(default_factory=list)
    nleft: int = 0  # of the current generation
    nup: int = 0
    ndone: int = 0
    departures: dict[str, Departure] = field(default_factory=dict)  # current generation's
    ready_spares: list[tuple[int, str]] = field(default_factory=list)  # (node, wid)
    # node -> {wid: slot} it runs; None: the node never said (its agent died before it did)
    hosted: dict[int, dict[str, int] | None] = field(default_factory=dict)
    lost_nodes: list[int] = field(default_factory=list)  # agents whose lease expired
    barred_nodes: list[int] = field(default_factory=list)  # newly quarantined nodes
    standby_nodes: list[int] = field(default_factory=list)  # standby nodes that joined


# ---------------------------------------------------------------- commands
@dataclass
class WriteTarget:
    target: SwitchTarget


@dataclass
class WritePlan:
    plan: GenPlan


@dataclass
class Order:
    node: int
    order: NodeOrder


@dataclass
class MarkDrained:
    wid: str


@dataclass
class AnswerDrain:
    index: int
    outcome: DrainOutcome


@dataclass
class MarkFinished:
    pass


@dataclass
class Record:
    event: Event
    fields: dict[str, Any]


@dataclass
class Say:
    text: str


class EndAction(StrEnum):
    FALLBACK = "fallback"  # restart every worker from the last checkpoint (already paid for)
    RESTART = "restart"  # a fault in-place recovery cannot take: a full restart, if budget allows
    GIVE_UP = "give_up"  # the job fails


@dataclass
class EndAttempt:
    action: EndAction
    fault: Fault
    reason: str


Command = WriteTarget | WritePlan | Order | MarkDrained | AnswerDrain | MarkFinished | Record | Say | EndAttempt


# ---------------------------------------------------------------- the decision
def decide(state: PlannerState, inbox: Inbox,
           config: PlannerConfig) -> tuple[PlannerState, list[Command]]:
    """One look at the inbox: the new state and what to do. Stops at the first EndAttempt."""
    s = copy.deepcopy(state)
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

    def record(self, event: Event, **fields: Any) -> None:
        self.out.append(Record(event, fields))

    def say(self, text: str) -> None:
        self.out.append(Say(text))

    def run(self) -> None:
        s, inbox = self.s, self.inbox
        s.deaths_seen += len(inbox.deaths)
        s.joiners_seen += len(inbox.joiners)
        s.stalls_seen += len(inbox.stalls)
        first_drain = s.drains_seen
        s.drains_seen += len(inbox.drains)
        for node in inbox.standby_nodes:
            if node not in s.standby_nodes:
                s.standby_nodes.append(node)
        for node in inbox.barred_nodes:
            if node not in s.barred_nodes:
                s.barred_nodes.append(node)
                s.refills = [r for r in s.refills if r.node != node]
        for node in inbox.lost_nodes:
            if node not in s.lost_nodes:
                self._node_lost(node)
                if self.ended:
                    return
        for death in filter(None, inbox.deaths):
            self._death(death)
            if self.ended:
                return
        for joiner in filter(None, inbox.joiners):
            self._joiner(joiner)
        for i, request in enumerate(inbox.drains):
            if request is not None:
                self._drain(first_drain + i, request)
        s.departed.update({w: d for w, d in inbox.departures.items()
                           if w in s.members and d.gen == s.gen})
        self._step()
        if not self.ended:
            self._stall()
        if not self.ended:
            self._order_refills()

    # ------------------------------------------------------------ spares
    def _free_spares(self, avoid: set[int]) -> list[tuple[int, str]]:
        """Ready spares not yet handed out, standby nodes first, none on `avoid` or lost nodes."""
        s = self.s
        found = [(n, w) for n, w in self.inbox.ready_spares
                 if w not in s.assigned and n not in avoid and n not in s.lost_nodes
                 and n not in s.barred_nodes]
        return sorted(found, key=lambda nw: nw[0] not in s.standby_nodes)

    def _assign(self, node: int, spare: str, slot: int) -> str:
        self.s.assigned.append(spare)
        self.out.append(Order(node, NodeOrder(OrderKind.PROMOTE, slot=slot, spare=spare)))
        self.record(Event.SPARE_ASSIGNED, wid=spare, slot=slot, spare_node=node)
        return spare

    # ------------------------------------------------------------ faults
    def _charge(self, fault: Fault) -> bool:
        """Spend one unit of the budget on `fault`; False (and the job ends) if none is left."""
        if self.s.budget.spend():
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
        s.lost_nodes.append(node)
        said = self.inbox.hosted.get(node)
        if said is None and node in s.layout:  # it died before it said: it ran what it started
            said = {f"{slot}.0": slot for slot in s.layout[node]}
        hosted = {w: slot for w, slot in (said or {}).items()
                  if w in s.members and w not in s.dead}
        detail = f"agent of node {node} silent past --node-timeout"
        if not hosted and (said is not None or node in s.standby_nodes):
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
            self.record(Event.FAULT, **death.event_fields())
            self._death(death)
            if self.ended:
                return
            if spare is None:
                s.refills = [r for r in s.refills if r.slot != slot]

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
            s.awaited.pop(death.slot, None)
            if s.promised.get(death.slot) == death.wid:
                del s.promised[death.slot]
        if not self._charge(death):
            return
        if member and s.recovery is not None and death not in s.recovery.faults:
            s.recovery.faults.append(death)
        if death.spare is None and death.slot is not None:
            spares = self._free_spares(avoid={death.node} if death.node is not None else set())
            if spares:  # its own node had no ready spare: take one from another node
                death.spare = self._assign(*spares[0], death.slot)
        if death.spare is not None:
            s.promised[death.slot] = death.spare
        elif death.slot is not None and death.node is not None and death.node not in s.lost_nodes \
                and death.node not in s.barred_nodes \
                and death.node not in s.standby_nodes:
            s.refills.append(Refill(death.slot, death.node, s.gen, self.now))

    def _joiner(self, joiner: Joiner) -> None:
        s = self.s
        if joiner.wid in s.dead:
            return
        s.slot_of[joiner.wid] = joiner.slot
        s.joiners.append(joiner.wid)
        s.awaited.pop(joiner.slot, None)
        if s.promised.get(joiner.slot) == joiner.wid:
            del s.promised[joiner.slot]

    def _order_refills(self) -> None:
        """Order replacements: at once under `wait`; under `shrink` once the survivors run a
        newer generation (a start-up beside their switch would slow it), or after a delay."""
        s, config = self.s, self.config
        for refill in list(s.refills):
            switched = s.phase == Phase.RUNNING and s.gen > refill.broke_gen
            if not (config.policy == Policy.WAIT or switched
                    or self.now - refill.since > config.replacement_delay):
                continue
            s.refills.remove(refill)
            s.awaited[refill.slot] = self.now
            self.out.append(Order(refill.node, NodeOrder(OrderKind.REPLACE, slot=refill.slot)))

    # ------------------------------------------------------------ hangs
    def _stall(self) -> None:
        """Blame a stall of the running generation on its culprits (`blame.blame`), once
        every member's node has reported where it stands (or a process is seen stopped)."""
        s = self.s
        for report in filter(None, self.inbox.stalls):
            if report.gen != s.gen:
                continue  # about a generation that is over
            if report.workers:
                s.stalls[report.node] = report
            else:
                s.stalls.pop(report.node, None)  # its workers move again
        if s.phase != Phase.RUNNING or not s.stalls:
            s.stall_since, s.stall_verdict = None, None
            return
        if s.stall_since is None:
            s.stall_since = self.now
        verdict = blame(s.members, s.stalls)
        if verdict.kind != VerdictKind.KILL and s.stall_verdict != verdict.kind:
            self.record(Event.STALL, gen=s.gen, verdict=verdict.kind.value, reason=verdict.reason)
        s.stall_verdict = verdict.kind.value
        if verdict.kind == VerdictKind.KILL:
            for c in verdict.culprits:
                if c.worker.wid in s.blamed:
                    continue
                s.blamed.append(c.worker.wid)
                self.out.append(Order(c.node, NodeOrder(OrderKind.KILL, slot=c.worker.slot,
                                                        wid=c.worker.wid, reason=verdict.reason)))
                self.record(Event.HANG_BLAMED, gen=s.gen, wid=c.worker.wid, slot=c.worker.slot,
                            culprit_node=c.node, step=c.worker.step,
                            progress=c.worker.progress, reason=verdict.reason,
                            reports=len(s.stalls))
            return
        stalled = self.now - s.stall_since
        # No culprit (yet): a network blip heals, a cut-off node is declared lost; a stall
        # that outlives both is a hang of the whole generation.
        if verdict.kind in (VerdictKind.STUCK, VerdictKind.WAIT) \
                and stalled > self.config.stall_limit:
            why = f"stalled {stalled:.0f}s and nobody to blame: {verdict.reason}"
            fault = Fault(kind=FaultKind.HANG, attempt=s.attempt, detail=why)
            self.say(f"hang with no single culprit ({why}): restarting every worker")
            self.end(EndAction.RESTART, fault, why)

    # ------------------------------------------------------------ drains
    def _drain(self, index: int, request: DrainRequest) -> None:
        """Have a ready spare promoted into each drained slot; the switch follows its join."""
        s = self.s

        def refuse(why: str) -> None:
            self.out.append(AnswerDrain(index, DrainOutcome(ok=False, error=why)))
            self.record(Event.DRAIN_REFUSED, request=request.as_event(), reason=why)
            self.say(f"drain refused: {why}")

        if s.phase != Phase.RUNNING or s.switch_requested:
            return refuse("a recovery or switch is in progress; try again in a moment")
        node = None
        if request.kind == DrainKind.NODE:
            node = request.target
            if node == 0:
                return refuse("node 0 hosts the control store and cannot be drained")
            hosted = self.inbox.hosted.get(node, {})
            movers = [m for m in s.members if m in hosted]
        else:
            movers = [m for m in s.members if s.slot_of[m] == request.target]
        if not movers:
            return refuse(f"no member of generation {s.gen} is on {request.describe()}")
        if len(movers) >= len(s.members):
            return refuse("a drain needs a member that stays to hand the state over")
        found = self._free_spares(avoid={node} if node is not None else set())
        if len(found) < len(movers):
            return refuse(f"{len(movers)} rank(s) to move but {len(found)} ready spare(s); "
                          "wait for spares to warm up, or add some")
        moves = {}
        for m, (spare_node, spare) in zip(movers, found, strict=False):
            s.draining[m] = (self._assign(spare_node, spare, s.slot_of[m]), index)
            moves[s.slot_of[m]] = spare
        self.record(Event.DRAIN_STARTED, request=request.as_event(), moves=moves)
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
            self.record(Event.FAULT, **fault.event_fields())
            self.say(f"fault: rank {fault.rank} exception: {fault.detail} (recovering in place)")
            if not self._charge(fault):
                return
        if any(r.reason == LeaveReason.NO_STATE for r in left.values()):
            why = next((r.error for r in left.values()
                        if r.reason == LeaveReason.NO_STATE and r.error), None)
            return self._fallback(why or "no live worker holds the committed state")
        if not any(r.holds_state for r in left.values()):
            return self._fallback("every worker that held the committed state is gone")
        members = list(left)
        missing = {s.slot_of[m] for m in s.members if m in s.dead}
        ready = [j for j in s.joiners if j not in members]
        filled = {s.slot_of[j] for j in ready}
        # A slot a hot spare was promoted into is worth waiting for under any policy: the
        # spare is warm and joins in milliseconds, and the world size stays as it was.
        if set(s.promised) - filled and self.now - rec.started < config.spare_wait:
            return
        # Sharded state cannot shrink in place (it would need resharding): such a job
        # always waits for its lost ranks' replacements.
        policy = Policy.WAIT if any(r.sharded for r in left.values()) else config.policy
        if policy == Policy.WAIT and missing - filled:
            coming = set(s.promised) | set(s.awaited) | {r.slot for r in s.refills}
            hopeless = sorted(missing - filled - coming)
            if hopeless:  # e.g. a standby node's rank: it starts no fresh worker
                fault = next(s.dead[m] for m in s.members
                             if m in s.dead and s.slot_of[m] == hopeless[0])
                why = (f"rank(s) {hopeless} cannot be refilled in place (no ready spare, and "
                       "no node to start a replacement): restarting every worker")
                self.say(why)
                return self.end(EndAction.RESTART, fault, why)
            if self.now - rec.started < config.join_timeout:
                return  # wait for the replacements to take the failed slots
        # A drained member gives its slot to its spare once the spare is here; it left
        # holding the state like everyone else, and is told to exit, not that it failed.
        drained = [m for m in members if m in s.draining and s.draining[m][0] in ready]
        for m in drained:
            self.out.append(MarkDrained(m))
            spare, index = s.draining.pop(m)
            s.moved.append((m, spare, index))
        members = [m for m in members if m not in drained] + ready
        s.joiners = [j for j in s.joiners if j not in members]
        self._plan(sorted(members, key=lambda m: s.slot_of[m]))

    def _plan(self, members: list[str]) -> None:
        s = self.s
        gen = s.gen + 1
        self.out.append(WritePlan(GenPlan(gen=gen, members=members)))
        self.record(Event.GEN_PLAN, gen=gen, world_size=len(members), members=members,
                    duration=round(self.now - s.recovery.started, 6) if s.recovery else None)
        s.gen, s.members = gen, members
        s.departed = {}
        s.stalls, s.stall_since, s.blamed, s.stall_verdict = {}, None, [], None
        # A promised spare not in this plan may still join later (it is then awaited like a
        # replacement); it is no reason to wait `spare_wait` in the next recovery.
        for slot, spare in list(s.promised.items()):
            if spare not in members:
                s.awaited[slot] = self.now
                del s.promised[slot]
        s.phase = Phase.FORMING
        s.planned_at = self.now

    def _formed(self) -> None:
        s = self.s
        s.phase = Phase.RUNNING
        rec = s.recovery
        self.record(Event.GEN_UP, gen=s.gen, world_size=len(s.members),
                    duration=round(self.now - rec.started, 6) if rec else None,
                    faults=[f.kind.value for f in rec.faults] if rec else [])
        if rec and rec.faults:
            s.recovered += len(rec.faults)
            self.say(f"recovered in place: generation {s.gen} of {len(s.members)} workers "
                     f"up {self.now - rec.started:.3f}s after the fault")
        s.recovery = None
        switch_s = round(self.now - rec.started, 6) if rec else None
        for member, spare, index in s.moved:
            move = {"rank": s.slot_of[spare], "from": member, "to": spare}
            s.moves.setdefault(index, []).append(move)
            self.record(Event.DRAINED, **move, gen=s.gen, switch_s=switch_s)
            self.say(f"drained rank {move['rank']}: {member} -> {spare}, generation {s.gen} "
                     f"up {switch_s}s after the switch began")
        for index in sorted({index for _, _, index in s.moved}):
            if not any(i == index for _, i in s.draining.values()):  # every rank moved
                self.out.append(AnswerDrain(index, DrainOutcome(
                    ok=True, moves=s.moves.pop(index), gen=s.gen, switch_s=switch_s)))
        s.moved = []

    def _fallback(self, why: str) -> None:
        """Restart every worker from the checkpoint. Paid for by the recovery's faults; a
        recovery with none (members left on peer errors, a switch that did not form) is a
        fault of its own, which the leader charges (`RESTART`)."""
        s = self.s
        paid = bool(s.recovery and s.recovery.faults)
        fault = copy.copy(s.recovery.faults[0] if paid
                          else Fault(kind=FaultKind.RECOVERY_FAILED, attempt=s.attempt))
        fault.detail = f"{fault.detail} ({why})".strip()
        self.record(Event.RECOVERY_FALLBACK, gen=s.gen, reason=why)
        self.say(f"in-place recovery impossible ({why}): restarting every worker")
        self.end(EndAction.FALLBACK if paid else EndAction.RESTART, fault, why)
