"""Every key of the control protocol, declared once, with its message type and its writer.

Keys live under the run's prefix (`unbroken/<run id>/`, added by the backend). Three shapes:

- `Slot`: one key holding one message, written by one role (or won by compare-and-set);
- `Counter`: an integer, only ever added to;
- `Queue`: an append-only mailbox, read in append order from an index (`Backend.append`).

A notifying counter or queue also bumps the attempt's `news` counter on every write (done in
`channel`, never by a caller), so the leader's planner, idle, polls one key. The protocol's
sequences are in docs/design-notes.md ("The control protocol").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from unbroken.control import messages as m

T = TypeVar("T")


@dataclass(frozen=True)
class Slot(Generic[T]):
    key: str
    type: Any  # the message type (or a plain type)
    writer: str  # who writes it: documentation, and the design notes' table


@dataclass(frozen=True)
class Counter:
    key: str
    writer: str
    notifies: str | None = None  # the news counter every add also bumps


@dataclass(frozen=True)
class Queue(Generic[T]):
    key: str  # entries live under `<key>/` (how, is the backend's: `Backend.append`)
    type: Any
    writer: str
    notifies: str | None = None  # the news counter every append also bumps

    def entry_key(self, request_id: str) -> str:
        """What an entry's signature binds: the queue and the append's request id."""
        return f"{self.key}/{request_id}"


@dataclass(frozen=True)
class Watched:
    """One key a watch keeps current (`prefix=False`), or every key under it (`prefix=True`)."""

    key: str
    prefix: bool = False


# ---------------------------------------------------------------- the job
CURRENT: Slot[int] = Slot("current", int, "leader: the attempt now open")
RESULT: Slot[m.Result] = Slot("result", m.Result, "leader, once: how the job ended")
LEADER: Slot[m.LeaderClaim] = Slot("leader", m.LeaderClaim,
                                   "agents, by compare-and-set: who leads the job")
NODE_RANKS: Counter = Counter("node_ranks", "each agent started without --node-rank, once: its "
                              "claim is its node rank (the TCPStore's host is node 0)")
STANDBY_IDS: Counter = Counter(
    "standby_ids", "each standby node started without --node-rank, and each returning node (a "
    "recreated pod whose node the job went on without), once: its claim k makes its node id "
    "`standby_id(nnodes, k)`")


def standby_id(nnodes: int, claim: int) -> int:
    """The node id of the `claim`-th standby node that claimed one (1: the first): from the
    first power of ten of at least 100 above --nnodes (100, 101, ... for a job of fewer than
    100 nodes), so that it never meets a node rank of the job. Pure."""
    return 10 ** max(2, len(str(nnodes))) + claim - 1


JOB_AUTH: Slot[m.JobAuth] = Slot(
    "auth", m.JobAuth, "the first agent to connect (the TCPStore's host, node 0), by "
    "compare-and-set, unsigned: whether and with which secret the job signs")
AUTH_REJECTIONS: Queue[m.AuthRejection] = Queue(
    "rejected", m.AuthRejection, "a newcomer whose secret differs from the job's, unsigned, "
    "as it leaves")
LEADER_RECORD: Slot[m.LeaderRecord] = Slot("leader_record", m.LeaderRecord,
                                           "leader, on change: budget and node set, for a successor")


def node_out(node: int) -> Slot[m.NodeOut]:
    return Slot(f"out/{node}", m.NodeOut, "leader: this node is out of the job, and why")


def ack(node: int) -> Slot[bool]:
    return Slot(f"ack/{node}", bool, "each follower: it has read the result")


def waiting(node: int) -> Slot[str]:
    return Slot(f"waiting/{node}", str, "an out node's new agent, which found the attempt "
                "running without it: its instance; it waits for the next attempt or the end")


def agent_lease(node: int, instance: str) -> Counter:
    return Counter(f"lease/{node}/{instance}", "the agent of the node: its liveness lease")


def fault_claim(name: str) -> Counter:
    return Counter(f"claim/fault/{name}", "workers: an injected fault fires once per job")


def loader_state(rank: int) -> Slot[m.LoaderState]:
    """Run-level: a rank's stateful loader survives attempts (a mark of a newer step than a
    restart resumes at is simply not used)."""
    return Slot(f"loader/{rank}", m.LoaderState,
                "the rank's worker (own loop, stateful loader): before each step it draws, "
                "latest only")


def torchrun_restart_prefix(restart: int) -> str:
    """Under plain torchrun, where a restart's workers rendezvous in torchrun's agent store
    (not a control-store key: torchrun reuses one store for every restart)."""
    return f"unbroken/restart_{restart}/"


# ---------------------------------------------------------------- one attempt
@dataclass(frozen=True)
class AttemptKeys:
    """The keys of attempt `attempt`: `AttemptKeys(a).plan`, `AttemptKeys(a).gen(g).left(w)`."""

    attempt: int

    def _k(self, key: str) -> str:
        return f"a/{self.attempt}/{key}"

    @property
    def _news(self) -> str:
        return self._k("news")

    # The attempt's rendezvous and end: leader and agents.
    def node_join(self, node: int) -> Slot[m.NodeJoin]:
        return Slot(self._k(f"node/{node}"), m.NodeJoin, "each agent, by compare-and-set")

    @property
    def plan(self) -> Slot[m.AttemptPlan]:
        return Slot(self._k("plan"), m.AttemptPlan, "leader")

    @property
    def fault(self) -> Slot[m.Fault]:
        return Slot(self._k("fault"), m.Fault, "any agent, by compare-and-set: ends the attempt")

    def node_done(self, node: int) -> Slot[m.NodeDone]:
        return Slot(self._k(f"done/{node}"), m.NodeDone, "the node's agent")

    def node_stopped(self, node: int) -> Slot[bool]:
        return Slot(self._k(f"stopped/{node}"), bool, "the node's agent: its workers are reaped")

    @property
    def planner_state(self) -> Slot[dict]:
        """The planner's state (`launch.planner.PlannerState`, as plain values: the control
        package does not import the launcher) with the clock it was written at."""
        return Slot(self._k("planner"), dict, "leader: after each decision that changed it")

    def node_released(self, node: int) -> Slot[bool]:
        return Slot(self._k(f"released/{node}"), bool, "a follower whose ranks were all drained")

    # In place: the leader's inbox. Every entry notifies the planner.
    @property
    def news(self) -> Counter:
        return Counter(self._k("news"), "channel, on every notifying write")

    @property
    def deaths(self) -> Queue[m.Fault]:
        return Queue(self._k("death"), m.Fault, "the dead worker's agent", notifies=self._news)

    @property
    def stalls(self) -> Queue[m.StallReport]:
        return Queue(self._k("stall"), m.StallReport,
                     "a node's agent, when its workers stop or start again making progress",
                     notifies=self._news)

    @property
    def joiners(self) -> Queue[m.Joiner]:
        return Queue(self._k("joiner"), m.Joiner, "replacements and promoted spares",
                     notifies=self._news)

    @property
    def drains(self) -> Queue[m.DrainRequest]:
        return Queue(self._k("drain"), m.DrainRequest, "`unbroken drain`", notifies=self._news)

    def drain_outcome(self, index: int) -> Slot[m.DrainOutcome]:
        return Slot(self._k(f"drain_outcome/{index}"), m.DrainOutcome, "leader")

    # In place: the leader's decisions.
    @property
    def target(self) -> Slot[m.SwitchTarget]:
        return Slot(self._k("target"), m.SwitchTarget, "leader: the switch every member makes")

    @property
    def latest_gen(self) -> Slot[int]:
        return Slot(self._k("gen"), int, "leader: the newest planned generation, after its plan")

    def drained(self, wid: str) -> Slot[bool]:
        return Slot(self._k(f"drained/{wid}"), bool, "leader: this member's rank went to a spare")

    @property
    def finished(self) -> Slot[bool]:
        return Slot(self._k("finished"), bool, "leader: every member of the newest generation "
                    "finished training; waiting joiners and spares go home")

    def orders(self, node: int) -> Queue[m.NodeOrder]:
        return Queue(self._k(f"orders/{node}"), m.NodeOrder, "leader: to the node's agent")

    # Spares, per node: what each agent offers and hosts.
    def ready_spares(self, node: int) -> Slot[list[str]]:
        return Slot(self._k(f"ready/{node}"), list[str], "the node's agent, on change")

    def hosted(self, node: int) -> Slot[dict[str, int]]:
        return Slot(self._k(f"hosts/{node}"), dict[str, int],
                    "the node's agent, on change: {wid: slot} of the members it runs")

    @property
    def standbys(self) -> Queue[m.StandbyJoin]:
        return Queue(self._k("standby"), m.StandbyJoin, "standby nodes' agents")

    def gen(self, gen: int) -> GenKeys:
        return GenKeys(self.attempt, gen)


@dataclass(frozen=True)
class GenKeys:
    """The keys of one generation of an attempt (in-place recovery)."""

    attempt: int
    number: int

    def _k(self, key: str) -> str:
        return f"a/{self.attempt}/g/{self.number}/{key}"

    @property
    def _news(self) -> str:
        return AttemptKeys(self.attempt).news.key

    @property
    def plan(self) -> Slot[m.GenPlan]:
        return Slot(self._k("plan"), m.GenPlan, "leader")

    @property
    def departures(self) -> Queue[m.NodeDepartures]:
        """Members that left the generation, one entry per node's gathering (its agent's
        write): the planner reads only the new ones, in one round trip, however many
        members there are."""
        return Queue(self._k("left"), m.NodeDepartures, "a node's agent (or a worker alone)",
                     notifies=self._news)

    @property
    def nready(self) -> Counter:
        return Counter(self._k("nready"), "members: arrived at the generation's barrier")

    @property
    def nup(self) -> Counter:
        return Counter(self._k("nup"), "members: switched (groups, state, build)",
                       notifies=self._news)

    @property
    def ndone(self) -> Counter:
        return Counter(self._k("ndone"), "members: finished training in it", notifies=self._news)

    @property
    def rendezvous_prefix(self) -> str:
        """Where the generation's process groups rendezvous (a c10d store prefix)."""
        return self._k("pg/")


# ---------------------------------------------------------------- what each role watches
# With etcd, an agent keeps a live copy of the keys it reads at every look (a watch stream,
# `etcd_watch.Mirror`), so that its looks cost no request. A follower watches only its own
# and the job-wide keys (never the leader's inbox: a recovery's N departures would reach
# all N followers); the leader watches its attempt, the agents' leases and the job's keys.
def leader_watch(attempt: int) -> list[Watched]:
    """The leader's watch: its attempt's keys (its inbox among them), every agent's lease
    (read in bulk at each look), the claim it must still hold, the job-wide slots."""
    return [Watched(f"a/{attempt}/", prefix=True), Watched("lease/", prefix=True),
            Watched(LEADER.key), Watched(RESULT.key), Watched(CURRENT.key),
            Watched("rejected/", prefix=True), Watched("out/", prefix=True)]


def follower_watch(attempt: int, node: int, leader: m.LeaderClaim | None) -> list[Watched]:
    """A follower's watch: what its looks read (the attempt's end, the leader's target and
    orders to this node, the job's result and leader, its own standing) and the leader's
    lease (its silence is judged from the copy, and confirmed by a read before acting)."""
    keys = AttemptKeys(attempt)
    watched = [Watched(keys.fault.key), Watched(keys.target.key), Watched(keys.plan.key),
               Watched(keys.latest_gen.key), Watched(keys.finished.key),
               Watched(keys.orders(node).key + "/", prefix=True),
               Watched(keys.drained("").key, prefix=True),
               Watched(LEADER.key), Watched(RESULT.key), Watched(CURRENT.key),
               Watched(LEADER_RECORD.key), Watched(node_out(node).key)]
    if leader is not None:
        watched.append(Watched(agent_lease(leader.node, leader.instance).key))
    return watched
