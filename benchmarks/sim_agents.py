"""Simulated agents for `failover.py`: many followers in a few processes, each running the
follower's real control look against a real store, and the leader's real planner.

A simulated follower is one agent whose workers are not processes: its own `Channel` over a
`RetryingBackend` (its own connection, as on its own host), its liveness lease refreshed
every `LEASE_PERIOD` on a connection of its own, and the agent's own look: a real
`AttemptWatch.look` with the real `Follower` role's duties (`Election.watch` on etcd, the
watch of its keys), over a `TrainingNode` that stands in for the `NodeSupervisor` of a node
whose workers all train. It looks every `cfg.quiet_poll` seconds, as a training node's
agent does. On `go`, every survivor's member posts its departure at once, as members whose
collective failed do, and the agent's next look sends it: one `NodeDepartures` append per
agent (`launch/workers/departure_relay.py`; one member per simulated agent, so the gathering of a
node's members is not what this measures). One thread drives the looks of many agents in
turn: 2,048 agents' loops of their own would not fit 2 cores.

The leader is the real `PlanExecutor` with the real `LeaseWatch` (paced as `Followers`
paces it) and, on etcd, the real leader watch and the claim check, looking every 50 ms
while idle and every 2 ms while busy, as the leader's `AttemptWatch` loop does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass

from unbroken.control.address import BackendKind, ControlAddress, open_backend
from unbroken.control.channel import Channel
from unbroken.control.lease import LeaseWatch
from unbroken.control.messages import (
    AttemptPlan,
    Departure,
    Fault,
    FaultKind,
    LeaderClaim,
    LeaveReason,
    NodeDepartures,
    NodeLayout,
)
from unbroken.control.retry import RetryingBackend
from unbroken.control.schema import (
    LEADER,
    AttemptKeys,
    agent_lease,
    leader_watch,
)
from unbroken.control.signing import Signer
from unbroken.launch.attempt import AttemptWatch
from unbroken.launch.config import LaunchConfig
from unbroken.launch.election import Election
from unbroken.launch.follower import Follower as FollowerRole
from unbroken.launch.leader.plan_executor import PlanExecutor
from unbroken.launch.planning.budget import RestartBudget
from unbroken.launch.planning.planner_state import Inbox, PlannerConfig, initial_state
from unbroken.launch.workers.departure_relay import DepartureGather
from unbroken.launch.workers.hang_watch import HangWatch
from unbroken.telemetry.events import EventLog

SECRET = b"b" * 32
LEASE_PERIOD = 2.0  # a follower's, at the default --node-timeout of 10 s
LEADER_LEASE_PERIOD = 0.4  # the leader's, at the default --leader-timeout of 2 s
NODE_TIMEOUT = 10.0


def quiet_poll(backend: str, n: int) -> float:
    """How often a quiet agent of a job of n nodes reads the control plane: the launcher's
    own `LaunchConfig.quiet_poll` (0: at every look, the 50 ms monitor interval)."""
    cfg = LaunchConfig(script="train.py")
    cfg.nnodes, cfg.backend = n, BackendKind(backend)
    return cfg.quiet_poll or 0.05


def _backend(backend: str, endpoint: str, run_id: str) -> RetryingBackend:
    address = ControlAddress(BackendKind(backend), (endpoint,))
    return RetryingBackend(lambda: open_backend(address, run_id, 10.0), window=10)


def requests_of(backend: RetryingBackend) -> int:
    """Requests a client made (etcd: counted per call; TCPStore: per store call)."""
    client = backend.client
    return client.kv.requests if hasattr(client, "kv") else client.requests


class TrainingNode:
    """What `AttemptWatch` and the `Follower` role ask of a node's `NodeSupervisor`, for a
    simulated node: its workers train (every look finds them stepping) but are not
    processes, so there is nothing to reap, stall or mirror. On `go` its member's departure
    is posted to its `PostBox`, whose real `DepartureGather` the real `AttemptWatch` empties
    into the store as a real agent does (`launch/workers/departure_relay.py`)."""

    def __init__(self, node: int) -> None:
        self.workers: list = []
        self.spares: list = []
        self.spare_target = 0
        self.standby = True  # no ranks to name when the attempt begins: none are processes
        self.hangs = HangWatch(node, lambda: [])
        self.departures = PostBox()

    def start_attempt(self, attempt: int, plan: object) -> None:
        pass

    def exited(self) -> list:
        return []

    def all_resilient(self) -> bool:
        return True

    def training(self) -> bool:
        return True

    def ready_spares(self) -> list:
        return []

    def all_exited_ok(self) -> bool:
        return False

    def mirror_target(self, target: object) -> None:
        pass

    def fill_pool(self, spawned_at: float) -> None:
        pass


class PostBox:
    """A `DepartureRelay` without its socket: what the simulated member posts."""

    path = None
    rejected = 0

    def __init__(self) -> None:
        self.gather = DepartureGather()
        self._posted: list[Departure] = []

    def post(self, departure: Departure) -> None:
        self._posted.append(departure)

    def receive(self, now: float) -> int:
        n = len(self._posted)
        for d in self._posted:
            self.gather.offer(0, d, now)
        self._posted.clear()
        return n


class Follower:
    """One simulated follower (see the module): the real `Follower` role's duties in the
    real `AttemptWatch.look`, over a node whose workers train (`TrainingNode`)."""

    def __init__(self, backend: str, endpoint: str, run_id: str, node: int,
                 plan: AttemptPlan) -> None:
        self.node = node
        self.instance = f"sim{node}"
        self.backend = _backend(backend, endpoint, run_id)
        self.channel = Channel(self.backend, Signer(SECRET))
        self.lease = _backend(backend, endpoint, run_id)
        cfg = LaunchConfig(script="train.py")
        cfg.nnodes, cfg.backend, cfg.node_rank = len(plan.nodes), BackendKind(backend), node
        election = (Election(self.channel, node, self.instance, 2.0)
                    if backend == "etcd" else None)
        self.supervisor = TrainingNode(node)
        events = EventLog(None)
        self.watch = AttemptWatch(cfg, self.channel, self.supervisor, events,
                                  say=lambda line: None, check_signal=lambda: None)
        self.role = FollowerRole(cfg, self.channel, self.watch, events, self.instance,
                                 sleep=lambda: time.sleep(0.02),
                                 report_failure=lambda fault, why: None, election=election)
        self.watch.begin(0, plan)
        self.looks = 0

    def refresh(self) -> None:
        self.lease.refresh_lease(agent_lease(self.node, self.instance).key)

    def look(self) -> None:
        self.watch.look(lambda: self.role._duties(0))  # noqa: SLF001 - the role's own look
        self.looks += 1

    def leave(self) -> None:
        self.supervisor.departures.post(Departure(
            wid=f"{self.node}.0", gen=0, step=10, holds_state=True, reason=LeaveReason.PEER,
            t=time.time()))


@dataclass
class Signals:
    measure: mp.Event  # the idle window starts
    go: mp.Event  # a member died: the idle window ends, survivors leave
    stop: mp.Event
    ready: mp.Queue  # each process: its pid once every agent looked once
    out: mp.Queue  # each process: FollowerFigures


@dataclass
class FollowerFigures:
    """What one process of followers measured."""

    agents: int
    idle_requests: int  # looks' and leases' requests between `measure` and `go`
    idle_s: float
    last_left: float  # wall time its last departure was written


def run_followers(backend: str, endpoint: str, run_id: str, nodes: list[int], dead: int,
                  sig: Signals, n: int, threads: int = 8) -> None:
    """The body of one process of simulated followers (`nodes`); `dead`'s member died."""
    plan = AttemptPlan(attempt=0, world_size=n + 1, worker_port=0, nodes={
        k: NodeLayout(offset=k, nproc=1, instance=f"sim{k}") for k in range(n + 1)})
    agents = [Follower(backend, endpoint, run_id, k, plan) for k in nodes]
    for a in agents:
        a.refresh()
        a.look()
    sig.ready.put(os.getpid())
    period = quiet_poll(backend, n)
    parts = [agents[i::threads] for i in range(min(threads, len(agents)))]
    left: list[float] = []

    def loop(part: list[Follower]) -> None:
        next_refresh, gone = 0.0, False
        while not sig.stop.is_set():
            t0 = time.monotonic()
            if t0 >= next_refresh:
                for a in part:
                    a.refresh()
                next_refresh = t0 + LEASE_PERIOD
            leaving = sig.go.is_set() and not gone
            if leaving:
                for a in part:
                    if a.node != dead:
                        a.leave()
                gone = True
            for a in part:
                a.look()  # after `leave`: the look that sends the departure
            if leaving:
                left.append(time.time())
            if not gone:  # a member's death reaches the survivors at once (their collective)
                sig.go.wait(max(0.0, period - (time.monotonic() - t0)))
            else:
                time.sleep(max(0.0, period - (time.monotonic() - t0)))

    def count() -> int:
        return sum(requests_of(a.backend) + requests_of(a.lease) for a in agents)

    workers = [threading.Thread(target=loop, args=(p,), daemon=True) for p in parts]
    for w in workers:
        w.start()
    sig.measure.wait()
    t0, c0 = time.monotonic(), count()
    sig.go.wait()
    t1, c1 = time.monotonic(), count()
    sig.stop.wait()
    for w in workers:
        w.join(5)
    sig.out.put(FollowerFigures(len(agents), c1 - c0, t1 - t0, max(left, default=0.0)))


class Leader:
    """The leader's side: the real planner executor, lease watch and (etcd) claim check."""

    def __init__(self, backend: str, endpoint: str, run_id: str, n: int) -> None:
        self.kind = backend
        self.backend = _backend(backend, endpoint, run_id)
        self.channel = Channel(self.backend, Signer(SECRET))
        self.world = n + 1  # slot 0 on the leader's node, 1..n on the followers
        self.state = initial_state(0, self.world, {k: [k] for k in range(self.world)},
                                   RestartBudget(10))
        self.executor = PlanExecutor(self.channel, 0, PlannerConfig(), lambda *a, **k: None,
                                     lambda s: None)
        self.leases = LeaseWatch(self.backend, pause_limit=NODE_TIMEOUT / 2,
                                 confirm_after=NODE_TIMEOUT / 2, every=NODE_TIMEOUT / 20)
        self.watched = [agent_lease(k, f"sim{k}") for k in range(1, self.world)]
        self.election: Election | None = None
        self.lease = _backend(backend, endpoint, run_id)
        if backend == "etcd":
            self.election = Election(self.channel, 0, "sim0", 2.0)
            self.election.mine = LeaderClaim(node=0, instance="sim0", term=0)
            self.channel.first(LEADER, self.election.mine)
            self.channel.fence_on(LEADER, self.election.mine)
            self.backend.watch(leader_watch(0))
        self.looks = 0
        # Its lease on a thread of its own, as the agent's (`Agent._keep_lease`): a slow look
        # must not make the leader look silent.
        self._stop = threading.Event()
        self._lease_thread = threading.Thread(target=self._keep_lease, daemon=True)
        self._lease_thread.start()

    def _keep_lease(self) -> None:
        while not self._stop.is_set():
            self.lease.refresh_lease(agent_lease(0, "sim0").key)
            self._stop.wait(LEADER_LEASE_PERIOD)

    def close(self) -> None:
        self._stop.set()
        self._lease_thread.join(5)

    @staticmethod
    def claim(backend: str, endpoint: str, run_id: str) -> None:
        """Write the leader's claim (etcd) and first lease, with no thread started: what the
        followers find when they start."""
        if backend == "etcd":
            channel = Channel(_backend(backend, endpoint, run_id), Signer(SECRET))
            channel.first(LEADER, LeaderClaim(node=0, instance="sim0", term=0))
            channel.backend.refresh_lease(agent_lease(0, "sim0").key)

    def look(self) -> None:
        now = time.monotonic()
        if self.election is not None:
            self.election.check_held()
        silent = self.leases.silent_many(self.watched, now)
        inbox = Inbox(now=now, wall=time.time(), in_place=True,
                      silences=dict(zip(range(1, self.world), silent, strict=True)))
        self.state, _ = self.executor.look(self.state, inbox, lambda: 10)
        self.looks += 1

    def publish_death(self, slot: int) -> float:
        t = time.time()
        self.channel.append(AttemptKeys(0).deaths, Fault(
            kind=FaultKind.CRASH, rank=slot, slot=slot, wid=f"{slot}.0", node=slot, attempt=0,
            in_place=True, t=t))
        self.channel.append(AttemptKeys(0).gen(0).departures, NodeDepartures(0, [Departure(
            wid="0.0", gen=0, step=10, holds_state=True, reason=LeaveReason.PEER, t=time.time())]))
        return t

    def pace(self) -> None:
        """The leader's look interval: 2 ms busy; idle, until its watch sees a change (at
        most 50 ms: the workers' own interval)."""
        if self.state.busy:
            time.sleep(0.002)
        else:
            self.backend.wait_change(self.backend.changes(), 0.05)
