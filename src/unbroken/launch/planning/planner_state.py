"""What the planner (`planner.decide`) knows, and what it is told.

`PlannerState` is a serialisable value (`control.codec`): the leader keeps it for the whole
job and persists it after each decision, so that a successor resumes it (`rebase` moves its
deadlines onto the successor's clock). It is grouped by concern into frozen records:

- `Spares`: spares promised to slots, replacements awaited or still to order;
- `Stalls`: the running generation's stall reports, and the hang culprits ordered killed;
- `Drains`: members being drained onto spares, and the moves made so far;
- `Nodes` (`node_life.py`): node lifecycle: lost, released, standing by, quarantined;
- `RestartBudget` (`budget.py`): the job's one restart budget;
- `Cursors`: how many entries of each inbox queue were taken in.

A record is frozen: outside `decide` (which works on a private copy) nobody changes one in
place; a new value replaces it.

`Inbox` is what the executor read from the store since the last look, plus the leader's
news of its nodes: lease silences, strikes, standby arrivals.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from unbroken.control.messages import (
    Departure,
    DrainRequest,
    Fault,
    Joiner,
    NodeSet,
    StallReport,
    StandbyJoin,
    SwitchTarget,
)
from unbroken.launch.planning import node_set
from unbroken.launch.planning.budget import RestartBudget
from unbroken.launch.planning.node_life import Nodes, Strike
from unbroken.launch.planning.node_set import QuarantineRule


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
    """What survivors do about a slot with no ready spare (`--on-fault`)."""
    recovery_timeout: float = 30.0
    """A generation that does not form within this falls back to a full restart."""
    join_timeout: float = 60.0
    """`wait`: how long survivors wait for a replacement, then shrink."""
    spare_wait: float = 5.0
    """How long a promised spare is waited for, under any policy, before planning without it."""
    replacement_delay: float = 2.0
    """`shrink`: a replacement is ordered once survivors run the next generation, or by then."""
    stall_limit: float = 60.0  # the leader makes it at least 3 x --node-timeout
    """A stall with no culprit (a member unreported and not lost, or every member alive at
    the same point: a network blip, a stuck file system) that lasts this long ends the
    attempt for a full restart."""
    node_timeout: float = 10.0
    """`--node-timeout`: an agent whose lease is silent longer is a lost node."""
    leader_timeout: float = 2.0
    """`--leader-timeout`: how long the predecessor of a leader that took over was silent."""
    quarantine: QuarantineRule = field(default_factory=QuarantineRule)
    """When strikes against a node quarantine it."""
    least: int = 0
    """Elastic: `--nnodes` MIN, below which a lost node ends the attempt (0: static)."""
    standby_takes_ranks: bool = False
    """Standby nodes hold spares, so they count towards `least`."""
    leader_node: int = 0
    """The node whose agent runs this planner: its own node is drained only once another
    agent leads (`elected`), never on the TCPStore."""
    elected: bool = False
    """Leadership is elected (etcd): the leader can hand the lead over or step down; else its
    node holds the store."""


@dataclass
class Recovery:
    started: float  # when the generation broke
    faults: list[Fault] = field(default_factory=list)
    held: int | None = None  # the newest committed step the survivors left with
    said_wait: bool = False  # the wait for a fixed world's refills was said


@dataclass
class Refill:
    """A slot whose replacement is to be ordered from `node` (not yet: see `_order_refills`)."""

    slot: int
    node: int
    broke_gen: int  # the generation the death broke
    since: float


@dataclass(frozen=True)
class Spares:
    """Who refills which slot."""

    promised: dict[int, str] = field(default_factory=dict)
    """Slot -> the spare promoted into it."""
    awaited: dict[int, float] = field(default_factory=dict)
    """Slot -> when its replacement was ordered."""
    refills: list[Refill] = field(default_factory=list)
    """Replacements still to order."""
    assigned: list[str] = field(default_factory=list)
    """Spares handed out."""
    ordered_from: dict[int, int] = field(default_factory=dict)
    """Slot -> the node whose spare was ordered into it (its heir, even if that spare died)."""


@dataclass(frozen=True)
class Stalls:
    """The current generation's stall: each node's latest report, when the first came, the
    culprits already ordered killed, and the last verdict recorded."""

    reports: dict[int, StallReport] = field(default_factory=dict)
    since: float | None = None
    culprits: list[str] = field(default_factory=list)
    verdict: str | None = None
    unreported_since: float | None = None
    """Since when a member's report has been missing (`culprit.UNREACHABLE_AFTER`)."""
    settle_until: float | None = None
    """Until when blame by position waits, after a member was unreachable."""


@dataclass(frozen=True)
class Drains:
    draining: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Member -> (its spare, the drain's index)."""
    moved: list[tuple[str, str, int]] = field(default_factory=list)
    """This switch's drains: (member, spare, index)."""
    moves: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Drain index -> its moves so far."""
    held: dict[int, DrainRequest] = field(default_factory=dict)
    """Drain index -> a drain of the leader's own node (etcd), held until another agent leads."""
    lead_to: int | None = None
    """The node this planner's leader hands the lead to, so that its own node can be drained."""


@dataclass(frozen=True)
class Cursors:
    """Entries of each inbox queue already taken in."""

    deaths: int = 0
    joiners: int = 0
    drains: int = 0
    stalls: int = 0
    standbys: int = 0


@dataclass
class PlannerState:
    """Everything the planner knows; serialisable with `control.codec`."""

    attempt: int
    budget: RestartBudget
    members: list[str]  # the current generation's, in rank order
    slot_of: dict[str, int]  # worker id -> logical slot
    nodes: Nodes
    gen: int = 0
    phase: Phase = Phase.RUNNING
    recovery: Recovery | None = None
    planned_at: float = 0.0
    dead: dict[str, Fault] = field(default_factory=dict)
    joiners: list[str] = field(default_factory=list)  # registered, not yet members
    departed: dict[str, Departure] = field(default_factory=dict)  # left the current generation
    switch_requested: bool = False
    target: SwitchTarget | None = None
    spares: Spares = field(default_factory=Spares)
    stalls: Stalls = field(default_factory=Stalls)
    drains: Drains = field(default_factory=Drains)
    seen: Cursors = field(default_factory=Cursors)
    recovered: int = 0  # faults recovered in place
    last_held: int = -1  # the `held` of the attempt's last recovery in place
    fixed_world: str | None = None  # what fixed the world size, as departures said: the
    #                                 attempt never shrinks (`planner_refills.policy`)
    finished: bool = False

    @property
    def busy(self) -> bool:
        """A recovery, switch or refill is under way: look again soon."""
        return self.phase != Phase.RUNNING or self.switch_requested or bool(self.spares.refills)


def job_state(max_restarts: int, job: NodeSet | None = None) -> PlannerState:
    """The state before the first attempt: the whole budget, the job's node set."""
    return initial_state(-1, 0, [], RestartBudget(max_restarts), job)


def initial_state(attempt: int, world_size: int, nodes: list[int] | dict[int, list[int]],
                  budget: RestartBudget, job: NodeSet | None = None) -> PlannerState:
    """Generation 0 of an attempt: every slot's first worker. `nodes` maps each node to the
    slots it starts with (or lists the nodes, when no layout is known); `job` is the job's
    node set (default: those nodes)."""
    slots = {f"{r}.0": r for r in range(world_size)}
    layout = dict(nodes) if isinstance(nodes, dict) else {}
    job = job if job is not None else node_set.initial(0)
    return PlannerState(attempt=attempt, budget=budget, members=list(slots), slot_of=slots,
                        nodes=Nodes(job=job, planned=list(nodes), layout=layout))


def rebase(state: PlannerState, shift: float) -> PlannerState:
    """The state with every monotonic time moved by `shift` seconds: how a successor on
    another host (another monotonic clock) resumes a persisted state. Deadlines keep the
    time they had left when the state was written, plus the time it lay in the store."""
    s = copy.deepcopy(state)
    s.planned_at += shift
    refills = [replace(r, since=r.since + shift) for r in s.spares.refills]
    s.spares = replace(s.spares, refills=refills,
                       awaited={slot: t + shift for slot, t in s.spares.awaited.items()})
    if s.recovery is not None:
        s.recovery.started += shift
    if s.stalls.since is not None:
        s.stalls = replace(s.stalls, since=s.stalls.since + shift)
    return s


@dataclass
class Inbox:
    """What the store said since the last look (read by the executor), and the leader's
    news of its nodes."""

    now: float  # seconds, monotonic (the leader's clock)
    wall: float = 0.0  # seconds, wall clock: a strike's time when its fault has none
    in_place: bool = True
    """False while the workers do not (yet) run the resilient loop: only node news is taken
    in, and a lost node ends the attempt."""
    max_step: int = 0  # the furthest step a member has reached
    # New entries of the queues; None stands for a forged entry (rejected, reported).
    deaths: list[Fault | None] = field(default_factory=list)
    joiners: list[Joiner | None] = field(default_factory=list)
    drains: list[DrainRequest | None] = field(default_factory=list)
    stalls: list[StallReport | None] = field(default_factory=list)
    standbys: list[StandbyJoin | None] = field(default_factory=list)  # standby nodes arrived
    nleft: int = 0  # of the current generation
    nup: int = 0
    ndone: int = 0
    departures: dict[str, Departure] = field(default_factory=dict)  # current generation's
    ready_spares: list[tuple[int, str]] = field(default_factory=list)  # (node, wid)
    # node -> {wid: slot} it runs; None: the node never said (its agent died before it did)
    hosted: dict[int, dict[str, int] | None] = field(default_factory=dict)
    silences: dict[int, float] = field(default_factory=dict)
    """Node -> seconds its agent's lease has not moved (the agents the leader watches)."""
    released: list[int] = field(default_factory=list)
    """Silent nodes that said they left on purpose (drained): no loss."""
    predecessor: int | None = None
    """A successor's first look: the node of the leader it took over from, lost."""
    strikes: list[Strike] = field(default_factory=list)
    """Faults to count against their nodes besides the deaths taken in (the fault that
    ended an attempt no planner recovered in place)."""
