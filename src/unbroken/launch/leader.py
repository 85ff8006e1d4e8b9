"""The leader role (the node-0 agent): opens attempts, plans them, watches the other
agents' leases, runs the in-place planner, spends the one restart budget, and publishes the
job's result. Its own node's workers are watched by the same `AttemptWatch` as a follower's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from unbroken.control.lease import LeaseWatch
from unbroken.control.messages import (
    AttemptPlan,
    Fault,
    FaultKind,
    NodeJoin,
    NodeLayout,
    Result,
    Status,
)
from unbroken.control.schema import CURRENT, RESULT, AttemptKeys, ack, agent_lease
from unbroken.control.tcp import serve_store
from unbroken.errors import ControlPlaneError, ExitCode
from unbroken.launch.attempt import Ending, Outcome
from unbroken.launch.budget import RestartBudget
from unbroken.launch.plan_executor import PlanExecutor
from unbroken.launch.planner import EndAction, PlannerConfig, Policy, initial_state
from unbroken.launch.role import Role
from unbroken.telemetry.event_names import Event


class Leader(Role):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        cfg = self.cfg
        self.budget = RestartBudget(cfg.max_restarts)  # the job's one restart budget
        self.leases = LeaseWatch(self.channel.backend)
        self.plan: AttemptPlan | None = None
        self._worker_store: Any = None  # the attempt's worker store; dropping it closes it
        self._executor: PlanExecutor | None = None
        self._standbys: dict[int, str] = {}  # standby node -> its agent's instance
        self._standbys_seen = 0
        self._lost: set[int] = set()
        self._released: set[int] = set()

    def run(self) -> int:
        cfg, ch = self.cfg, self.channel
        attempt = 0
        while True:
            t0 = time.monotonic()
            ch.write(CURRENT, attempt)
            keys = AttemptKeys(attempt)
            ch.first(keys.node_join(cfg.node_rank), NodeJoin(
                nproc=cfg.nproc_per_node, instance=self.instance, pid=os.getpid(),
                host=os.uname().nodename))
            plan = self._make_plan(attempt, self._wait_joined(attempt))
            ch.write(keys.plan, plan)
            self.events.emit(Event.RENDEZVOUS, attempt=attempt, world_size=plan.world_size,
                             duration=round(time.monotonic() - t0, 6), worker_port=plan.worker_port)
            outcome = self.watch.run(attempt, plan, lambda a=attempt: self._duties(a))
            if self._executor is not None:
                self.budget = self._executor.state.budget  # spent in place
            if outcome.ending == Ending.DONE:
                ch.write(RESULT, Result(Status.SUCCESS, attempt=attempt))
                self.say(f"all {plan.world_size} workers finished (attempts: {attempt + 1})")
                self._wait_acks()
                return ExitCode.SUCCESS
            self._end_attempt(attempt, outcome)
            fault = outcome.fault
            end = outcome.end
            if end is not None and end.action == EndAction.GIVE_UP:
                return self._fail(fault, end.reason)
            if not (end is not None and end.action == EndAction.FALLBACK) \
                    and not self.budget.spend():
                return self._fail(fault, f"the restart budget of {cfg.max_restarts} is spent")
            attempt += 1
            self.events.emit(Event.RESTART, attempt=attempt, restarts_left=self.budget.left,
                             reason=fault.kind.value if fault else None)
            self.say(f"restarting all workers: attempt {attempt} of at most {cfg.max_restarts + 1}")

    # ---------------------------------------------------------------- an attempt's rendezvous
    def _wait_joined(self, attempt: int) -> dict[int, NodeJoin]:
        cfg, keys = self.cfg, AttemptKeys(attempt)
        deadline = time.monotonic() + cfg.rdzv_timeout
        told = False
        while True:
            nodes = {k: self.channel.read(keys.node_join(k)) for k in range(cfg.nnodes)}
            missing = [k for k, v in nodes.items() if v is None]
            if not missing:
                return nodes
            if not told and time.monotonic() > deadline - cfg.rdzv_timeout + 3:
                self.say(f"waiting up to {cfg.rdzv_timeout:g}s for node(s) {missing} to join")
                told = True
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"node(s) {missing} did not join within {cfg.rdzv_timeout:g}s; start their "
                    f"agents with --nnodes {cfg.nnodes} and the same --master-addr/--master-port/--rdzv-id"
                )
            self._sleep()

    def _make_plan(self, attempt: int, nodes: dict[int, NodeJoin]) -> AttemptPlan:
        store, worker_port = serve_store(self.cfg.master_addr, 0, self.cfg.rdzv_timeout)
        self._worker_store = store
        offset, layout = 0, {}
        for k in range(self.cfg.nnodes):
            layout[k] = NodeLayout(offset=offset, nproc=nodes[k].nproc, instance=nodes[k].instance)
            offset += nodes[k].nproc
        self.plan = AttemptPlan(attempt=attempt, world_size=offset, nodes=layout,
                                worker_port=worker_port)
        self.leases.reset()
        self._lost.clear()
        self._released.clear()
        self._standbys.clear()
        self._standbys_seen = 0
        cfg = self.cfg
        self._executor = None
        if self.watch.in_place:
            slots = {k: list(range(n.offset, n.offset + n.nproc)) for k, n in layout.items()}
            state = initial_state(attempt, offset, slots, self.budget)
            config = PlannerConfig(policy=Policy(cfg.on_fault), recovery_timeout=cfg.recovery_timeout,
                                   join_timeout=cfg.join_timeout)
            self._executor = PlanExecutor(self.channel, state, config, self.events.emit, self.say)
        return self.plan

    # ---------------------------------------------------------------- each look
    def _duties(self, attempt: int) -> Outcome | None:
        """The leader's part of each look: standby nodes, leases, the planner, the end."""
        ch, keys, watch = self.channel, AttemptKeys(attempt), self.watch
        for join in ch.entries(keys.standbys, self._standbys_seen):
            self._standbys_seen += 1
            if join is not None:  # None: forged, rejected
                self._standbys[join.node] = join.instance
        lost = self._check_leases(attempt)
        ex = self._executor
        if ex is not None and watch.resilient:
            end = ex.look(self.watch.sup.max_step, sorted(self._lost), sorted(self._standbys))
            watch.busy = ex.state.busy
            if end is not None:
                return Outcome(Ending.FAULT, watch.publish_fault(end.fault, attempt), end)
        elif lost is not None:
            return Outcome(Ending.FAULT, watch.publish_fault(lost, attempt))
        # Only once this node is done: until then no attempt can be, and reading every
        # node's key at every look would cost the idle leader N reads per look.
        if watch.done_posted and self._all_done(keys):
            return Outcome(Ending.DONE)
        return None

    def _followers(self) -> dict[int, str]:
        """Every other agent of the attempt (planned nodes and standby nodes): its instance."""
        nodes = {k: n.instance for k, n in self.plan.nodes.items() if k != self.cfg.node_rank}
        nodes.update(self._standbys)
        return nodes

    def _check_leases(self, attempt: int) -> Fault | None:
        """Declare lost every agent whose lease has not moved for --node-timeout."""
        now, keys, first = time.monotonic(), AttemptKeys(attempt), None
        for k, instance in self._followers().items():
            if k in self._lost or k in self._released:
                continue
            silent = self.leases.silent_for(agent_lease(k, instance), now)
            if silent <= self.cfg.node_timeout:
                continue
            if self.channel.read(keys.node_released(k)):
                self._released.add(k)  # drained, then left on purpose
                continue
            self._lost.add(k)
            detail = f"agent of node {k} silent for {silent:.1f}s"
            self.events.emit(Event.NODE_LOST, attempt=attempt, lost_node=k, detail=detail)
            self.say(f"node {k} lost: {detail}")
            first = first or Fault(kind=FaultKind.NODE_LOST, node=k, detail=detail)
        return first

    def _all_done(self, keys: AttemptKeys) -> bool:
        """Done only when every rank of the world has trained to the end: every member of
        the final generation reported done (in place), or every rank's worker exited 0."""
        ex = self._executor
        # A standby node is waited for only once it runs ranks of the job.
        hosting = {k for k in self._standbys if self.channel.read(keys.hosted(k))}
        ranks: set[int] = set()
        for k in (set(self.plan.nodes) | hosting) - self._lost - self._released:
            if k != self.cfg.node_rank and self.channel.read(keys.node_released(k)):
                self._released.add(k)  # drained, and left
                continue
            done = self.channel.read(keys.node_done(k))
            if done is None:
                return False
            ranks.update(done.ranks)
        finished = ex is not None and ex.state.finished
        return finished or ranks >= set(range(self.plan.world_size))

    # ---------------------------------------------------------------- endings
    def _end_attempt(self, attempt: int, outcome: Outcome) -> None:
        self.watch.stop_workers(attempt, outcome.fault)
        self._wait_stopped(attempt)
        self._worker_store = None  # the last reference: the store closes its port

    def _wait_stopped(self, attempt: int) -> None:
        """Wait until every live follower has stopped its workers of this attempt."""
        keys = AttemptKeys(attempt)
        deadline = time.monotonic() + self.cfg.kill_grace + self.cfg.node_timeout
        pending = set(self._followers()) - self._released
        while pending and time.monotonic() < deadline:
            pending = {k for k in pending if not self.channel.read(keys.node_stopped(k))}
            self._check_leases(attempt)
            pending -= self._lost
            if pending:
                self._sleep()

    def _fail(self, fault: Fault | None, reason: str) -> int:
        self.channel.write(RESULT, Result(Status.FAILED, fault=fault, reason=reason))
        self._report_failure(fault, reason)
        self._wait_acks()
        return ExitCode.WORKERS_FAILED

    def _wait_acks(self) -> None:
        """Keep the store up until the followers have read the result (bounded)."""
        if self.plan is None:
            return
        deadline = time.monotonic() + 5.0
        followers = set(self._followers()) - self._released - self._lost
        while followers and time.monotonic() < deadline:
            followers = {k for k in followers if not self.channel.read(ack(k))}
            if followers:
                time.sleep(0.02)

    def interrupted(self, signum: int) -> None:
        self.channel.write(RESULT, Result(Status.INTERRUPTED, signal=signum))
        self._wait_acks()
