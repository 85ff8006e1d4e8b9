"""The leader role: a shell of I/O around the planner. It opens attempts and plans them,
reads the other agents' leases, hands what it reads to the planner (`plan_executor.look`,
`planner.decide`), and publishes the job's result. Its own node's workers are watched by
the same `AttemptWatch` as a follower's.

The leader holds one `PlannerState` for the whole job, and it alone: the restart budget,
node lifecycle (lost, released, standing by, quarantined: `node_life.py`) and the job's node
set live there. Each look hands the planner the lease silences, and the executor adds what
the store says; the state comes back from `look`, never out of the executor. Between
attempts the leader applies the same `node_life` functions to it.

With the TCPStore the node-0 agent leads for the whole job. With etcd the leader is elected
(`election.py`): a follower that takes over calls `run(takeover=...)`, which resumes the
attempt under way from what the old leader persisted (`LeaderRecord`, the planner's state)
and declares the old leader's node lost.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import replace
from typing import Any

from unbroken.control.messages import (
    AttemptPlan,
    Fault,
    FaultKind,
    LeaderRecord,
    NodeJoin,
    NodeLayout,
    NodeOut,
    NodeSet,
    Result,
    Status,
)
from unbroken.control.schema import (
    CURRENT,
    LEADER_RECORD,
    RESULT,
    AttemptKeys,
    ack,
    leader_watch,
    waiting,
)
from unbroken.control.tcp import serve_store
from unbroken.errors import ErrorClass, ExitCode
from unbroken.launch.attempt import Ending, Outcome
from unbroken.launch.election import Elected, HandedOver
from unbroken.launch.leader.leader_chores import Rejections, start_telemetry, stranded_reason
from unbroken.launch.leader.leader_followers import Followers
from unbroken.launch.leader.leader_rendezvous import Rendezvous
from unbroken.launch.leader.plan_executor import PlanExecutor
from unbroken.launch.planning import node_life, node_set
from unbroken.launch.planning.budget import RestartBudget
from unbroken.launch.planning.node_life import Strike
from unbroken.launch.planning.planner_commands import EndAction, EndAttempt
from unbroken.launch.planning.planner_state import (
    Inbox,
    PlannerConfig,
    PlannerState,
    Policy,
    initial_state,
    job_state,
)
from unbroken.launch.role import Role
from unbroken.polling import PollTimeout, poll_until
from unbroken.telemetry import schema as ev
from unbroken.telemetry.job_ledger import CapacityLedger
from unbroken.telemetry.live import LiveTelemetry

_LOOK = 0.02  # seconds between two looks while waiting: the role's sleep (the agent's default)


class Leader(Role):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        # The job's one state: its restart budget, and its nodes (for the next full restart;
        # elastic: whoever joins the first), with what became of each.
        self.state: PlannerState = job_state(
            cfg.recovery.max_restarts, node_set.initial(0 if cfg.joins_freely else cfg.nnodes))
        self.followers = Followers(cfg, self.channel)  # the other agents, their leases
        self.plan: AttemptPlan | None = None
        self._worker_store: Any = None  # the attempt's worker store; dropping it closes it
        self._executor: PlanExecutor | None = None
        self._predecessor: int | None = None  # the silent old leader, for the next look
        self._recorded: LeaderRecord | None = None  # the LeaderRecord last written
        self._rejections = Rejections(self.channel, self.events, self.say)
        self._stepping_down = False  # SIGTERM on etcd: leaving without ending the job
        self._handover_blocked: int | None = None  # the heir a handover could not reach, said
        self.rendezvous = Rendezvous(self)
        self._live: LiveTelemetry | None = None  # while it leads: the job-wide series

    @property
    def budget(self) -> RestartBudget:
        """The job's one restart budget (a view of the state)."""
        return self.state.budget

    @property
    def nodes(self) -> NodeSet:
        """The job's node set (a view of the state)."""
        return self.state.nodes.job

    @nodes.setter
    def nodes(self, job: NodeSet) -> None:
        self.state.nodes = node_life.with_job(self.state.nodes, job)

    def run(self, takeover: Elected | None = None) -> int:
        self._live = live = start_telemetry(self.cfg, self.say, self.metrics)
        try:
            return self._lead(takeover)
        finally:
            if live is not None:
                live.close()

    def _lead(self, takeover: Elected | None) -> int:
        cfg = self.cfg
        attempt, outcome = 0, None
        if takeover is not None:
            attempt, outcome = self._take_over(takeover)
        while True:
            if outcome is None:
                outcome = self._open(attempt)
            if outcome.ending == Ending.DONE:
                self.channel.write(RESULT, Result(Status.SUCCESS, attempt=attempt))
                self.say(f"all {self.plan.world_size} workers finished (attempts: {attempt + 1})")
                self._wait_acks()
                return ExitCode.SUCCESS
            self._end_attempt(attempt, outcome)
            fault, end = outcome.fault, outcome.end
            if self._stranded():
                return self._fail(fault, stranded_reason(self.cfg, self.nodes), ExitCode.QUARANTINED)
            if end is not None and end.action == EndAction.GIVE_UP:
                return self._fail(fault, end.reason)
            if fault is not None and fault.error_class == ErrorClass.STOP:  # not in place
                return self._fail(fault, f"rank {fault.rank} stopped the job: {fault.detail}")
            if not (end is not None and end.action == EndAction.FALLBACK):
                paid = self.budget.spend()
                if paid is None:
                    return self._fail(fault, f"the restart budget of "
                                             f"{cfg.recovery.max_restarts} is spent")
                self.state.budget = paid
            attempt += 1
            self.events.emit(ev.Restart(attempt=attempt, restarts_left=self.budget.left,
                             reason=fault.kind.value if fault else None))
            self.say(f"restarting all workers: attempt {attempt} of at most "
                     f"{cfg.recovery.max_restarts + 1}")
            outcome = None

    def _open(self, attempt: int) -> Outcome:
        """Open `attempt`: wait for the job's nodes, plan, start this node's part, watch it."""
        cfg, ch = self.cfg, self.channel
        t0 = time.monotonic()
        self.save_record(attempt)  # before `current`: joining agents read the node order
        ch.write(CURRENT, attempt)
        keys = AttemptKeys(attempt)
        ch.first(keys.node_join(cfg.node_rank), NodeJoin(
            nproc=cfg.nproc_per_node, instance=self.instance, pid=os.getpid(),
            host=os.uname().nodename))
        self.rendezvous.join_seen = {}
        plan = self._make_plan(attempt, self.rendezvous.wait_joined(attempt))
        # Each follower bounds its clock offset from these and its join's `sent` (clock.py).
        plan.clock_seen = {k: t for k, t in self.rendezvous.join_seen.items() if k in plan.nodes}
        plan.clock_written = time.time()
        ch.write(keys.plan, plan)
        self.events.emit(ev.Rendezvous(attempt=attempt, world_size=plan.world_size,
                         duration=round(time.monotonic() - t0, 6), worker_port=plan.worker_port,
                         nodes=list(plan.nodes)))
        self.events.emit(ev.ClockOffset(attempt=attempt, offset=0.0, error=0.0))
        return self.watch.run(attempt, plan, lambda a=attempt: self._duties(a))

    # ---------------------------------------------------------------- taking over
    def _take_over(self, elected: Elected) -> tuple[int, Outcome | None]:
        """Continue the job where the old leader left it. Returns the attempt and, if this
        node was running it, how it ended under this leader; None: open the attempt anew."""
        ch, old = self.channel, elected.previous
        record = ch.read(LEADER_RECORD)
        if record is not None:
            self.state.budget = replace(self.budget, spent=record.restarts_spent)
            self.nodes = record.nodes
            if self._live is not None and record.capacity:  # the capacity counter goes on
                self._live.stats.ledger = CapacityLedger.from_plain(record.capacity)
        current = ch.read(CURRENT)
        attempt = current if current is not None else 0
        self.events.emit(ev.LeaderElected(attempt=attempt, term=self.election.mine.term,
                         previous=old.node if old else None, handed=elected.handed))
        why = (f": node {old.node} handed it over" if elected.handed
               else f": node {old.node}'s agent went silent")
        self.say(f"leading the job from now on (term {self.election.mine.term})"
                 + (why if old else ""))
        if elected.handed:
            old = None  # its node is not lost: its agent follows, and the drain moves its ranks
        plan = ch.read(AttemptKeys(attempt).plan) if current is not None else None
        # This node runs the attempt: its agent is one of the plan's, or a standby node's
        # that joined it (its spares, and any ranks they took, go on under its lead).
        in_attempt = (getattr(plan.nodes.get(self.cfg.node_rank), "instance", None) == self.instance
                      or (self.cfg.standby and self.watch.keys is not None
                          and self.watch.keys.attempt == attempt)) if plan is not None else False
        running = (in_attempt and elected.attempt == attempt
                   and ch.read(AttemptKeys(attempt).fault) is None)
        if not running:  # between attempts, or this node has no part in it: open the next
            if elected.attempt is not None and self.watch.keys is not None:
                self.watch.stop_workers(elected.attempt, None)
            if old is not None:
                self.nodes = node_set.mark_out(self.nodes, old.node, NodeOut.LOST)
            return (attempt + 1 if current is not None else 0), None
        self.plan = plan
        self._reset_attempt()
        self._start_planner(attempt, plan, resume=True)
        if old is not None and old.node in plan.nodes:  # its workers went with its agent
            self._predecessor = old.node  # the planner's first look declares it lost
        return attempt, self.watch.watch(lambda a=attempt: self._duties(a))

    def _make_plan(self, attempt: int, nodes: dict[int, NodeJoin]) -> AttemptPlan:
        cfg = self.cfg
        store, worker_port = serve_store(cfg.bind_addr, 0, cfg.rdzv_timeout)
        self._worker_store = store
        offset, layout = 0, {}
        for k in self.nodes.order:
            layout[k] = NodeLayout(offset=offset, nproc=nodes[k].nproc, instance=nodes[k].instance)
            offset += nodes[k].nproc
        self.plan = AttemptPlan(attempt=attempt, world_size=offset, nodes=layout,
                                worker_port=worker_port, worker_addr=cfg.bind_addr)
        self._reset_attempt()
        self._start_planner(attempt, self.plan, resume=False)
        self.save_record(attempt)
        self.events.emit(ev.NodeSet(attempt=attempt, order=list(self.nodes.order),
                         out={k: v.value for k, v in self.nodes.out.items()}))
        return self.plan

    def _reset_attempt(self) -> None:
        self.followers.reset()
        self._predecessor = None

    def _start_planner(self, attempt: int, plan: AttemptPlan, resume: bool) -> None:
        """The attempt's executor, and its state: a new one (the budget and the job's node
        set carry over), or, on a takeover, the one the old leader persisted."""
        cfg = self.cfg
        # `--on-fault restart` plans no generations (the inbox says not in place): its
        # planner takes in node news only, and never reads the policy.
        on_fault = cfg.recovery.on_fault
        config = PlannerConfig(
            policy=Policy(on_fault) if on_fault in {p.value for p in Policy} else Policy.SHRINK,
            recovery_timeout=cfg.recovery.recovery_timeout,
            stall_limit=max(60.0, 3 * cfg.node_timeout), join_timeout=cfg.recovery.join_timeout,
            node_timeout=cfg.node_timeout, leader_timeout=cfg.etcd.leader_timeout,
            quarantine=cfg.recovery.quarantine, least=cfg.least if cfg.elastic else 0,
            standby_takes_ranks=cfg.spares_when_standing_by, leader_node=cfg.node_rank,
            elected=cfg.elects)
        self._executor = PlanExecutor(self.channel, attempt, config, self.events.emit, self.say)
        self.channel.backend.watch(leader_watch(attempt))  # etcd: looks read a live copy
        if resume and (state := PlanExecutor.resume(self.channel, attempt)) is not None:
            self.state = state
            return
        slots = {k: list(range(n.offset, n.offset + n.nproc)) for k, n in plan.nodes.items()}
        self.state = initial_state(attempt, plan.world_size, slots, self.budget, self.nodes)

    def save_record(self, attempt: int) -> None:
        """Persist the budget and the node set for a successor, when they changed."""
        ledger = self._live.stats.ledger if self._live is not None else None
        record = LeaderRecord(attempt=attempt, restarts_spent=self.budget.spent, nodes=self.nodes,
                              capacity=ledger.plain() if ledger is not None else None)
        if record != self._recorded:
            self.channel.write(LEADER_RECORD, record)
            self._recorded = copy.deepcopy(record)

    # ---------------------------------------------------------------- each look
    def _duties(self, attempt: int) -> Outcome | None:
        """The leader's part of each look: leadership, the planner (fed the lease silences:
        it declares nodes lost, takes standby nodes in, quarantines), the end."""
        keys, watch = AttemptKeys(attempt), self.watch
        if self.election is not None:
            self.election.check_held()
        self._rejections.record()
        silences, released = self.followers.silences(attempt, self.plan, self.state.nodes)
        inbox = Inbox(now=time.monotonic(), wall=time.time(), in_place=watch.resilient,
                      silences=silences, released=released, predecessor=self._predecessor)
        self.state, end = self._executor.look(self.state, inbox, watch.sup.max_step)
        self._predecessor = None
        self.save_record(attempt)
        heir = self.state.drains.lead_to
        if end is None and heir is not None and heir != self.cfg.node_rank:
            self._hand_lead(attempt, heir)
        watch.busy = watch.resilient and self.state.busy
        if end is not None:
            return Outcome(Ending.FAULT, watch.publish_fault(end.fault, attempt), end)
        if watch.resilient and not self.state.busy:  # not while a recovery counts on the node
            self.followers.send_off(attempt, self.plan, self.state.nodes)
        back = self.rendezvous.node_back(attempt)
        if back is not None:  # in the order again: the next attempt waits for it
            self.nodes, _ = node_set.admit(self.nodes, back)
            fault = watch.publish_fault(Fault(
                kind=FaultKind.NODE_LOST, node=back,
                detail=f"node {back} is back (a new agent) while the job runs short of "
                       f"--nnodes {self.cfg.nnodes}: restarting to take it in"), attempt)
            return Outcome(Ending.FAULT, fault, EndAttempt(EndAction.FALLBACK, fault, "node back"))
        # Only once this node is done: until then no attempt can be, and reading every
        # node's key at every look would cost the idle leader N reads per look.
        if watch.done_posted and self._all_done(keys):
            return Outcome(Ending.DONE)
        return None

    def _hand_lead(self, attempt: int, node: int) -> None:
        """The planner holds a drain of this leader's own node: hand the lead to `node`'s
        agent (after the look that persisted the planner's state, which the heir resumes)
        and go on as a follower (`HandedOver`); the heir drains this node."""
        instance = self.followers.of(self.plan, self.state.nodes).get(node)
        if instance is None or self.election is None:
            # Not expected: the planner names a node that runs ranks of the attempt, and
            # holds no drain without an election. The drain stays held (its requester's
            # wait is bounded); said once, and tried again at each look.
            if self._handover_blocked != node:
                self._handover_blocked = node
                why = "no election (TCPStore)" if self.election is None else "its agent is unknown"
                self.events.emit(ev.LeadHandoverBlocked(attempt=attempt, to=node, reason=why))
                self.say(f"cannot hand the lead to node {node}: {why}; the drain waits")
            return
        heir = self.election.hand_to(node, instance)
        self.events.emit(ev.LeadHandedOver(attempt=attempt, to=node, term=heir.term))
        self.say(f"handed the lead to node {node} (term {heir.term}); it moves this node's "
                 "ranks to spares")
        raise HandedOver(attempt, keep=self._worker_store)

    # ---------------------------------------------------------------- quarantines
    def _strike(self, attempt: int, fault: Fault) -> None:
        """Count the fault that ended an attempt no planner recovered in place against its
        node: the planner takes the strike in (and may quarantine the node)."""
        if fault.node is None or fault.kind == FaultKind.NODE_LOST:
            return
        inbox = Inbox(now=time.monotonic(), wall=time.time(), in_place=False,
                      strikes=[Strike(fault.node, fault.t or time.time())])
        self.state, _ = self._executor.look(self.state, inbox)
        self.save_record(attempt)

    def _all_done(self, keys: AttemptKeys) -> bool:
        """Done only when every rank of the world has trained to the end: every member of
        the final generation reported done (in place), or every rank's worker exited 0."""
        nodes = self.state.nodes
        # A standby node is waited for only once it runs ranks of the job.
        hosting = {k for k in nodes.standby if self.channel.read(keys.hosted(k))}
        ranks: set[int] = set()
        for k in (set(self.plan.nodes) | hosting) - set(nodes.lost) - set(nodes.released):
            if k != self.cfg.node_rank and self.channel.read(keys.node_released(k)):
                self.state.nodes = node_life.release(self.state.nodes, k)  # drained, and left
                continue
            done = self.channel.read(keys.node_done(k))
            if done is None:
                return False
            ranks.update(done.ranks)
        return self.state.finished or ranks >= set(range(self.plan.world_size))

    # ---------------------------------------------------------------- endings
    def _end_attempt(self, attempt: int, outcome: Outcome) -> None:
        if outcome.fault is not None and not self.watch.in_place:
            self._strike(attempt, outcome.fault)
        self.watch.stop_workers(attempt, outcome.fault)
        self._wait_stopped(attempt)
        self._worker_store = None  # the last reference: the store closes its port
        self._next_node_set(attempt)

    def _next_node_set(self, attempt: int) -> None:
        """Who the next attempt waits for: drained nodes leave the order, and a standby node
        that took over an out node's ranks takes its place."""
        keys = AttemptKeys(attempt)
        self.state.nodes = node_life.drained_out(self.state.nodes)
        layout = {k: list(range(n.offset, n.offset + n.nproc)) for k, n in self.plan.nodes.items()}
        hosted = {k: set((self.channel.read(keys.hosted(k)) or {}).values())
                  for k in set(self.plan.nodes) | set(self.state.nodes.standby)}
        # A node whose spare was ordered into a slot is its heir, even if that worker died since.
        for slot, k in self.state.spares.ordered_from.items():
            hosted.setdefault(k, set()).add(slot)
        job, heirs = node_set.after_attempt(self.nodes, layout, hosted)
        self.nodes = job
        for out, heir in heirs.items():
            self.events.emit(ev.NodeTakenOver(attempt=attempt, out_node=out, by=heir))
        self.save_record(attempt)

    def _wait_stopped(self, attempt: int) -> None:
        """Wait until every live follower has stopped its workers of this attempt."""
        keys = AttemptKeys(attempt)
        pending = set(self.followers.of(self.plan, self.state.nodes)) - set(self.state.nodes.released)

        def all_stopped() -> bool | None:
            nonlocal pending
            pending = {k for k in pending if not self.channel.read(keys.node_stopped(k))}
            # No planner looks now: the lease silences go into the state here.
            silences, released = self.followers.silences(attempt, self.plan, self.state.nodes)
            self.state.nodes, said, _ = node_life.silences(
                self.state.nodes, silences, released, self.cfg.node_timeout, attempt)
            self._executor.carry_out(said)
            self.save_record(attempt)
            pending -= set(self.state.nodes.lost)
            return None if pending else True

        if pending:
            try:
                poll_until(all_stopped, self.cfg.kill_grace + self.cfg.node_timeout, _LOOK,
                           sleep=lambda _: self._sleep(), what="the followers' stop")
            except PollTimeout:
                pass  # the next attempt's rendezvous deals with a follower still stopping

    def _fail(self, fault: Fault | None, reason: str,
              code: ExitCode = ExitCode.GAVE_UP) -> int:
        self.channel.write(RESULT, Result(Status.FAILED, fault=fault, reason=reason))
        self._report_failure(fault, reason)
        self._wait_acks()
        return code

    def _stranded(self) -> bool:
        """A static job whose every node is out, with no standby node to take their ranks:
        the next attempt would wait for nobody, forever (a one-node job whose node was
        quarantined). Elastic jobs wait for newcomers, bounded by --rdzv-timeout."""
        return not self.cfg.joins_freely and node_life.stranded(self.state.nodes)

    def _wait_acks(self, clear: bool = True) -> None:
        """Keep the store up until the followers have read the result (bounded). `clear`:
        with etcd, the job's keys outlive it: delete them once every follower has read the
        result (the TCPStore goes away with this agent)."""
        nodes = self.state.nodes
        followers = set() if self.plan is None else \
            set(self.followers.of(self.plan, nodes)) - set(nodes.released) - set(nodes.lost)
        # An out node's new agent that waits for the next attempt reads the result too.
        out = sorted(set(nodes.lost) | set(nodes.released))
        if out:
            found = self.channel.read_many([waiting(k) for k in out])
            followers |= {k for k, w in zip(out, found, strict=True) if w is not None}

        def all_read() -> bool | None:
            nonlocal followers
            followers = {k for k in followers if not self.channel.read(ack(k))}
            return None if followers else True

        if followers:
            try:
                poll_until(all_read, 5.0, 0.02, what="the followers' acks")
            except PollTimeout:
                pass  # bounded: a follower that never reads the result is not waited for
        if clear and self.election is not None:
            self.channel.backend.delete_prefix()

    def hand_off(self) -> bool:
        """SIGTERM as a notice (a pod deletion, an eviction, a spot reclaim), to a leader on
        etcd: it steps down rather than end the job, when the other nodes hold enough ready
        spares for its ranks. It stops its workers and leaves with no result written (so
        `interrupted` writes none); within --leader-timeout another agent takes over,
        declares this node lost and moves its ranks onto those spares in place, as when a
        leader's host dies. False with the embedded store (this agent holds it: its
        SIGTERM ends the job), or with too few spares (the job then stops, as before)."""
        plan, keys = self.plan, self.watch.keys
        if self.election is None or plan is None or keys is None or not self.watch.in_place:
            return False
        me = self.cfg.node_rank
        mine = plan.nodes.get(me)
        nodes = self.state.nodes
        others = (set(plan.nodes) | set(nodes.standby)) - set(nodes.lost) - set(nodes.released) - {me}
        if mine is None or not others:
            return False
        ready = self.channel.read_many([keys.ready_spares(k) for k in sorted(others)])
        if sum(len(r or []) for r in ready) < mine.nproc:
            return False
        self._stepping_down = True
        self.events.emit(ev.LeaderSteppedDown(attempt=plan.attempt, ranks=mine.nproc))
        self.say("SIGTERM: stepping down; another agent takes over and moves this node's "
                 "ranks to spares")
        return True

    def interrupted(self, signum: int, held_ranks: bool = True) -> None:
        if self._stepping_down:
            return  # no result: the job goes on under the next leader
        self.channel.write(RESULT, Result(Status.INTERRUPTED, signal=signum))
        self._wait_acks(clear=False)
