"""The typed messages of the control protocol. Each is written under one key of `schema`.

Who writes and who reads each is in `schema` and in docs/design-notes.md ("The control
protocol"). Messages hold plain values only; `codec` turns them to and from JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from unbroken.control.codec import to_plain


class FaultKind(StrEnum):
    """What went wrong."""

    CRASH = "crash"  # killed by a signal
    EXIT = "exit"  # exited non-zero without an error report
    EXCEPTION = "exception"  # the script raised
    HANG = "hang"  # stalled past the hang timeout, blamed by progress; killed by its agent
    NODE_LOST = "node_lost"  # an agent silent past --node-timeout
    AGENT_STOPPED = "agent_stopped"  # a follower's agent got SIGINT or SIGTERM
    RECOVERY_FAILED = "recovery_failed"  # an in-place recovery failed with no fault of its own


@dataclass
class Fault:
    """A fault, published once: who, what and when. `in_place` faults are deaths that the
    leader's planner recovers from; the others end the attempt."""

    kind: FaultKind
    detail: str = ""
    rank: int | None = None  # the global rank at attempt start (the slot); None: a node
    node: int | None = None  # the node that hosted it (or the lost node)
    pid: int | None = None
    exit_code: int | None = None  # negative: the signal
    step: int | None = None  # the last step its heartbeat showed
    traceback: str | None = None
    error_file: str | None = None  # the worker's error file (torchrun's error.json)
    local_rank: int | None = None
    host: str | None = None
    error_class: str | None = None  # an exception's `errors.ErrorClass`: peer, own_device, user
    attempt: int | None = None
    t: float | None = None  # wall time it was published
    reported_by: int | None = None  # the node whose agent published it
    # In place: the process (worker id, "<slot>.<incarnation>" or a spare's) and its slot.
    in_place: bool | None = None
    wid: str | None = None
    slot: int | None = None
    spare: str | None = None  # a ready spare promoted into the slot by the dead worker's agent
    # Hangs: how long it was silent, when it went silent (wall time), the timeout used.
    silent_for: float | None = None
    hang_started: float | None = None
    timeout: float | None = None

    def where(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"node {self.node}"

    def event_fields(self) -> dict[str, Any]:
        """The fields of its `fault` event (docs/events.md): set ones, `t` left out."""
        plain = to_plain(self)
        return {k: v for k, v in plain.items()
                if k != "t" and (v is not None or k in ("rank", "node"))}


@dataclass
class NodeJoin:
    """An agent's answer to an attempt's call: it is here, with this many workers."""

    nproc: int
    instance: str  # the agent's instance id: a restarted agent is a new instance
    pid: int
    host: str
    sent: float | None = None  # the agent's wall time just before writing it (`control.clock`)


@dataclass
class NodeLayout:
    offset: int  # the global rank of its local rank 0
    nproc: int
    instance: str


@dataclass
class AttemptPlan:
    """The leader's plan of an attempt: ranks per node, and the attempt's worker store."""

    attempt: int
    world_size: int
    nodes: dict[int, NodeLayout]
    worker_port: int
    worker_addr: str = ""  # where the leader serves the attempt's worker store
    # The leader's wall times: when it first read each node's join, and just before it wrote
    # this plan. With the join's `sent`, they bound each node's clock offset (`control.clock`).
    clock_seen: dict[int, float] = field(default_factory=dict)
    clock_written: float | None = None


@dataclass
class NodeDone:
    """A node's workers all exited 0; `ranks` are the ones that trained to the end here."""

    ranks: list[int]


@dataclass
class SwitchTarget:
    """Every member leaves its generation at `step` and joins generation `gen`; step -1
    (`runtime.heartbeat.LEAVE_NOW`): at once, mid-step (the generation is broken)."""

    gen: int
    step: int


@dataclass
class WorkerProgress:
    """Where one worker of a stalled node stands (read from its heartbeat page)."""

    wid: str
    slot: int
    step: int
    progress: int  # points passed inside the step (`runtime.heartbeat`)
    phase: int  # its heartbeat phase (`runtime.heartbeat.PHASE_*`)
    silent_for: float  # seconds since its step (or phase) began
    frozen_for: float | None  # seconds since its watchdog thread last ran; None: no watchdog
    timeout: float  # its step timeout, calibrated from its step times
    stopped: bool = False  # its process is stopped (state T in /proc, read by its agent)


@dataclass
class LoaderState:
    """A rank's stateful loader before the `micro`-th batch of the run (own loop)."""

    micro: int
    epoch: int
    world_size: int  # of the world it was drawn for: a mark of another size is never used
    state: str  # the loader's state_dict, torch.save'd and base64'd: loaded weights_only


@dataclass
class StallReport:
    """A node's word that its workers have stopped making progress in generation `gen`, with
    where each of them stands; `workers` empty: they move again. Written by the node's agent
    when that changes, read by the leader, which finds the culprit (`launch/planning/culprit.py`)."""

    node: int
    gen: int
    workers: list[WorkerProgress] = field(default_factory=list)


@dataclass
class GenPlan:
    """A generation's membership: worker ids in rank order."""

    gen: int
    members: list[str]


class LeaveReason(StrEnum):
    PEER = "peer"  # a collective failed: a peer died or left
    EXCEPTION = "exception"  # the worker's own step raised
    SWITCH = "switch"  # asked to move at a step boundary
    SUPERSEDED = "superseded"  # a member died before the generation formed
    NO_STATE = "no_state"  # the state cannot come from a peer (sharded)
    OUT_OF_MEMORY = "out_of_memory"  # a switch ran out of memory: freed, and tried again


@dataclass
class Departure:
    """Why and with what state a member left a generation."""

    wid: str
    gen: int
    step: int  # committed steps held
    holds_state: bool
    reason: LeaveReason
    t: float
    error: str | None = None
    traceback: str | None = None
    sharded: bool = False  # its state is sharded: the job cannot shrink in place
    fixed_world: str | None = None  # what fixed its world size (a framework that caches it,
    #                                 e.g. "the Trainer"): the job cannot shrink in place


@dataclass
class NodeDepartures:
    """The members of one node that left a generation, in one write: their agent gathers
    them (`launch/workers/departure_relay.py`), so a node of eight workers costs the control plane
    one append, not eight. A worker that cannot reach its agent writes its own (one)."""

    node: int
    departures: list[Departure]


@dataclass
class RelayedDeparture:
    """A worker's departure on its way to its agent (`control/departure_post.py`): the
    attempt names the queue it goes to."""

    attempt: int
    departure: Departure


@dataclass
class Joiner:
    """A replacement (or promoted spare) waiting to be placed in `slot`."""

    wid: str
    slot: int


class DrainKind(StrEnum):
    RANK = "rank"
    NODE = "node"


@dataclass
class DrainRequest:
    """`unbroken drain`: move one rank, or every rank of a node, onto ready spares."""

    kind: DrainKind
    target: int  # the rank (slot) or the node

    def describe(self) -> str:
        return f"{self.kind.value} {self.target}"

    def as_event(self) -> dict[str, int]:
        """As the drain events show it: {"slot": R} or {"node": K}."""
        return {"slot" if self.kind == DrainKind.RANK else "node": self.target}


@dataclass
class DrainOutcome:
    ok: bool
    error: str | None = None
    moves: list[dict[str, Any]] = field(default_factory=list)
    gen: int | None = None
    switch_s: float | None = None


@dataclass
class StandbyJoin:
    node: int
    instance: str


class OrderKind(StrEnum):
    PROMOTE = "promote"  # put ready spare `spare` into `slot`
    REPLACE = "replace"  # start a fresh worker for `slot` (its previous process is dead)
    LEAVE = "leave"  # stop every process of the node and leave the job (quarantine); slot -1
    KILL = "kill"  # kill worker `wid` in `slot`: the leader blamed it for a hang (`reason`)


@dataclass
class NodeOrder:
    """The leader's order to one node's agent."""

    kind: OrderKind
    slot: int
    spare: str | None = None
    wid: str | None = None  # KILL: the worker (its slot may hold another process by then)
    reason: str | None = None  # KILL: why the leader blamed it


class Status(StrEnum):
    SUCCESS = "success"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


@dataclass
class Result:
    """The job's outcome, written once by the leader; every agent exits by it."""

    status: Status
    attempt: int | None = None
    fault: Fault | None = None
    reason: str | None = None  # the one line that says why it failed
    signal: int | None = None  # the leader's, when interrupted


@dataclass
class LeaderClaim:
    """Who leads the job: won by compare-and-set, taken over by compare-and-set from a
    leader whose agent lease has been silent for --leader-timeout."""

    node: int
    instance: str
    term: int  # 0 for the first leader, +1 at each takeover


@dataclass
class JobAuth:
    """How the job's control messages are signed, agreed at first contact (`control.auth`):
    the first agent's word (node 0's with the TCPStore), written unsigned, since it is what a
    newcomer checks its own secret against."""

    signed: bool
    fingerprint: str | None = None
    """An HMAC of a fixed label under the job's secret: equal fingerprints prove the same
    secret without revealing it. None when the job runs unsigned."""
    incarnation: str | None = None
    """The declaring agent's instance: makes each job's declaration unique, so that a
    compare-and-set on it (`launch.dead_job.clear`) can only ever take a dead job's keys,
    never those of the next job under the same id. Not compared by `auth.mismatch`."""


@dataclass
class AuthRejection:
    """A newcomer that found its secret differs from the job's, and left (unsigned: its
    signature could not be checked anyway). The leader records it as an event."""

    node: int
    host: str
    reason: str


class NodeOut(StrEnum):
    """Why a node is no longer one of the job's nodes."""

    LOST = "lost"  # its agent's lease expired
    DRAINED = "drained"  # every rank moved to spares, and it left
    QUARANTINED = "quarantined"  # too many faults in the window: not used again


@dataclass
class NodeSet:
    """The job's nodes (`launch/planning/node_set.py` changes it): who a full restart waits for."""

    order: list[int]
    """Nodes whose workers hold the world's ranks, in rank order."""
    out: dict[int, NodeOut] = field(default_factory=dict)
    faults: dict[int, list[float]] = field(default_factory=dict)
    """Node -> wall times of the faults blamed on it (the quarantine's window)."""


@dataclass
class LeaderRecord:
    """What a successor needs besides each attempt's keys; the leader rewrites it on change."""

    attempt: int
    restarts_spent: int
    nodes: NodeSet
    capacity: dict[str, Any] | None = None  # the leader's capacity ledger (`job_ledger`)
