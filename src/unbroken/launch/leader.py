"""The leader role: opens attempts, plans them, watches the other agents' leases, runs the
in-place planner, spends the one restart budget, keeps the job's node set, and publishes
the job's result. Its own node's workers are watched by the same `AttemptWatch` as a
follower's.

With the TCPStore the node-0 agent leads for the whole job. With etcd the leader is elected
(`election.py`): a follower that takes over calls `run(takeover=...)`, which resumes the
attempt under way from what the old leader persisted (`LeaderRecord`, the planner's state)
and declares the old leader's node lost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from unbroken.control.channel import Channel
from unbroken.control.lease import LeaseWatch
from unbroken.control.messages import (
    AttemptPlan,
    DrainKind,
    DrainRequest,
    Fault,
    FaultKind,
    LeaderRecord,
    NodeJoin,
    NodeLayout,
    NodeOrder,
    NodeOut,
    OrderKind,
    Result,
    Status,
)
from unbroken.control.schema import (
    AUTH_REJECTIONS,
    CURRENT,
    LEADER_RECORD,
    NODE_RANKS,
    RESULT,
    AttemptKeys,
    ack,
    agent_lease,
    node_out,
)
from unbroken.control.tcp import serve_store
from unbroken.errors import ControlPlaneError, ExitCode, UserError
from unbroken.launch import node_set
from unbroken.launch.attempt import Ending, Outcome
from unbroken.launch.budget import RestartBudget
from unbroken.launch.election import Elected
from unbroken.launch.plan_executor import PlanExecutor
from unbroken.launch.planner import EndAction, EndAttempt, PlannerConfig, Policy, initial_state
from unbroken.launch.role import Role
from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import EVENTS_FILE
from unbroken.telemetry.live import LiveTelemetry


class Leader(Role):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        self.budget = RestartBudget(cfg.max_restarts)  # the job's one restart budget
        # The job's nodes, for the next full restart (elastic: whoever joins the first).
        self.nodes = node_set.initial(0 if cfg.joins_freely else cfg.nnodes)
        self.leases = LeaseWatch(self.channel.backend, pause_limit=cfg.node_timeout / 2)
        self.plan: AttemptPlan | None = None
        self._worker_store: Any = None  # the attempt's worker store; dropping it closes it
        self._executor: PlanExecutor | None = None
        self._standbys: dict[int, str] = {}  # standby node -> its agent's instance
        self._standbys_seen = 0
        self._lost: set[int] = set()
        self._released: set[int] = set()
        self._leaving: set[int] = set()  # quarantined nodes ordered to leave
        self._draining: set[int] = set()  # quarantined nodes whose ranks a drain moves
        self._join_seen: dict[int, float] = {}  # node -> wall time its join was first read
        self._rejections_seen = 0  # AUTH_REJECTIONS entries recorded as events
        self._rejections_read = 0.0  # monotonic time of the last look at them
        self._stepping_down = False  # SIGTERM on etcd: leaving without ending the job
        self._back_looked = 0.0  # monotonic time of the last look for returned nodes

    def run(self, takeover: Elected | None = None) -> int:
        live = self._start_telemetry(takeover is not None)
        try:
            return self._lead(takeover)
        finally:
            if live is not None:
                live.close()

    def _start_telemetry(self, takeover: bool) -> LiveTelemetry | None:
        """Prometheus /metrics (with --metrics-port) and the status line, for as long as this
        agent leads. A port that cannot be bound is the user's to fix: one line, exit 2 at
        start; an agent taking over a running job says so and leads without metrics."""
        cfg = self.cfg
        if cfg.metrics_port is None and not cfg.status_every:
            return None
        metrics = (cfg.metrics_addr, cfg.metrics_port) if cfg.metrics_port is not None else None
        try:
            live = LiveTelemetry(Path(cfg.run_dir) / EVENTS_FILE, self.say, metrics=metrics,
                                 status_every=cfg.status_every)
        except OSError as exc:
            if takeover:
                self.say(f"warning: cannot serve /metrics on {cfg.metrics_addr}:"
                         f"{cfg.metrics_port} ({exc.strerror or exc}); leading without metrics")
                return None
            raise UserError(f"--metrics-port {cfg.metrics_port}: cannot serve /metrics on "
                            f"{cfg.metrics_addr}: {exc.strerror or exc}; choose a free port "
                            "(or --metrics-addr)") from None
        if live.export is not None:
            host, bound = live.export.server.server_address[:2]
            self.say(f"metrics: http://{host}:{bound}/metrics")
        return live

    def _lead(self, takeover: Elected | None) -> int:
        cfg = self.cfg
        attempt, outcome = 0, None
        if takeover is not None:
            attempt, outcome = self._take_over(takeover)
        while True:
            if outcome is None:
                outcome = self._open(attempt)
            if self._executor is not None:
                self.budget = self._executor.state.budget  # spent in place
            if outcome.ending == Ending.DONE:
                self.channel.write(RESULT, Result(Status.SUCCESS, attempt=attempt))
                self.say(f"all {self.plan.world_size} workers finished (attempts: {attempt + 1})")
                self._wait_acks()
                self._clear()
                return ExitCode.SUCCESS
            self._end_attempt(attempt, outcome)
            fault, end = outcome.fault, outcome.end
            if self._stranded():
                return self._fail(fault, self._stranded_reason(), ExitCode.QUARANTINED)
            if end is not None and end.action == EndAction.GIVE_UP:
                return self._fail(fault, end.reason)
            if not (end is not None and end.action == EndAction.FALLBACK) \
                    and not self.budget.spend():
                return self._fail(fault, f"the restart budget of {cfg.max_restarts} is spent")
            attempt += 1
            self.events.emit(Event.RESTART, attempt=attempt, restarts_left=self.budget.left,
                             reason=fault.kind.value if fault else None)
            self.say(f"restarting all workers: attempt {attempt} of at most {cfg.max_restarts + 1}")
            outcome = None

    def _open(self, attempt: int) -> Outcome:
        """Open `attempt`: wait for the job's nodes, plan, start this node's part, watch it."""
        cfg, ch = self.cfg, self.channel
        t0 = time.monotonic()
        self._save_record(attempt)  # before `current`: joining agents read the node order
        ch.write(CURRENT, attempt)
        keys = AttemptKeys(attempt)
        ch.first(keys.node_join(cfg.node_rank), NodeJoin(
            nproc=cfg.nproc_per_node, instance=self.instance, pid=os.getpid(),
            host=os.uname().nodename))
        self._join_seen = {}
        plan = self._make_plan(attempt, self._wait_joined(attempt))
        # Each follower bounds its clock offset from these and its join's `sent` (clock.py).
        plan.clock_seen = {k: t for k, t in self._join_seen.items() if k in plan.nodes}
        plan.clock_written = time.time()
        ch.write(keys.plan, plan)
        self.events.emit(Event.RENDEZVOUS, attempt=attempt, world_size=plan.world_size,
                         duration=round(time.monotonic() - t0, 6), worker_port=plan.worker_port,
                         nodes=list(plan.nodes))
        self.events.emit(Event.CLOCK_OFFSET, attempt=attempt, offset=0.0, error=0.0)
        return self.watch.run(attempt, plan, lambda a=attempt: self._duties(a))

    # ---------------------------------------------------------------- taking over
    def _take_over(self, elected: Elected) -> tuple[int, Outcome | None]:
        """Continue the job where the old leader left it. Returns the attempt and, if this
        node was running it, how it ended under this leader; None: open the attempt anew."""
        ch, old = self.channel, elected.previous
        record = ch.read(LEADER_RECORD)
        if record is not None:
            self.budget.spent = record.restarts_spent
            self.nodes = record.nodes
        current = ch.read(CURRENT)
        attempt = current if current is not None else 0
        self.events.emit(Event.LEADER_ELECTED, attempt=attempt, term=self.election.mine.term,
                         previous=old.node if old else None)
        self.say(f"leading the job from now on (term {self.election.mine.term})"
                 + (f": node {old.node}'s agent went silent" if old else ""))
        plan = ch.read(AttemptKeys(attempt).plan) if current is not None else None
        running = (plan is not None and elected.attempt == attempt
                   and ch.read(AttemptKeys(attempt).fault) is None
                   and getattr(plan.nodes.get(self.cfg.node_rank), "instance", None) == self.instance)
        if not running:  # between attempts, or this node has no part in it: open the next
            if elected.attempt is not None and self.watch.keys is not None:
                self.watch.stop_workers(elected.attempt, None)
            if old is not None:
                self.nodes = node_set.mark_out(self.nodes, old.node, NodeOut.LOST)
            return (attempt + 1 if current is not None else 0), None
        self.plan = plan
        self._reset_attempt()
        self._executor = self._planner(attempt, plan, resume=True)
        if old is not None and old.node in plan.nodes:  # its workers went with its agent
            self._declare_lost(attempt, old.node, f"the leader's agent (node {old.node}) went "
                               f"silent for {self.cfg.leader_timeout:g}s")
        return attempt, self.watch.watch(lambda a=attempt: self._duties(a))

    # ---------------------------------------------------------------- an attempt's rendezvous
    def _wait_gathered(self, attempt: int) -> dict[int, NodeJoin]:
        """Elastic (`--nnodes MIN:MAX`, or ranks in join order): the nodes `node_set.gather`
        picks from the agents that joined; agents beyond the cap stand by this attempt."""
        cfg, keys, ch = self.cfg, AttemptKeys(attempt), self.channel
        rule = node_set.Gathering(least=cfg.least, cap=cfg.cap, last_call=cfg.last_call)
        # The last attempt's standing-by nodes are on their way to rejoin: a restart admits them.
        stood_by = ch.entries(AttemptKeys(attempt - 1).standbys, 0) if attempt else []
        expected = tuple(sorted({j.node for j in stood_by if j is not None} - self._lost))
        t0 = time.monotonic()
        enough_at: float | None = None
        told = False
        while True:
            known = list(range(ch.count(NODE_RANKS) + 1))  # every rank handed out so far
            joins = dict(zip(known, ch.read_many([keys.node_join(k) for k in known]), strict=True))
            joined = {k: j for k, j in joins.items() if j is not None}
            self._note_joins(joined)
            now = time.monotonic()
            gathered, enough = node_set.gather(self.nodes, list(joined), cfg.node_rank, rule,
                                               attempt, None if enough_at is None else now - enough_at,
                                               expected)
            if gathered is not None:
                break
            self._lose_silent_members(attempt, set(joined))
            if enough and enough_at is None:
                enough_at = now
                self.say(f"{len(joined)} node(s) joined (at least {cfg.least}); waiting up to "
                         f"{cfg.last_call:g}s for more, up to {cfg.cap}")
            if not told and not enough and now - t0 > 3:
                self.say(f"{len(joined)} node(s) joined; waiting up to {cfg.rdzv_timeout:g}s "
                         f"for at least {cfg.least}")
                told = True
            if now - t0 > cfg.rdzv_timeout:
                missing = [k for k in self.nodes.order if k not in self.nodes.out
                           and k not in joined]
                raise ControlPlaneError(
                    f"only {len(joined)} node(s) joined within {cfg.rdzv_timeout:g}s, fewer than "
                    f"the --nnodes minimum of {cfg.least}; start more agents with the same "
                    "--rdzv-endpoint/--rdzv-id, or lower MIN" if len(joined) < cfg.least else
                    f"node(s) {missing} of the last attempt did not rejoin within "
                    f"{cfg.rdzv_timeout:g}s though their agents are alive")
            self._sleep()
        self.nodes = gathered
        return {k: joined[k] for k in gathered.order}

    def _lose_silent_members(self, attempt: int, joined: set[int]) -> None:
        """While an elastic rendezvous waits for the last attempt's nodes: one whose agent
        went silent since (it died between attempts) is lost, not waited for."""
        if self.plan is None:
            return
        waited = {k: n.instance for k, n in self.plan.nodes.items()
                  if k in self.nodes.order and k not in self.nodes.out and k not in joined}
        silences = self.leases.silent_many([agent_lease(k, i) for k, i in waited.items()],
                                           time.monotonic())
        for k, silent in zip(waited, silences, strict=True):
            if silent > self.cfg.node_timeout:
                self._declare_lost(attempt, k, f"agent of node {k} silent for {silent:.1f}s "
                                   "while the next attempt gathered")

    def _wait_joined(self, attempt: int) -> dict[int, NodeJoin]:
        """Wait for every node of the node set (lost, drained and quarantined nodes are not
        waited for); a node that comes back by then is admitted too."""
        if self.cfg.joins_freely:
            return self._wait_gathered(attempt)
        cfg, keys = self.cfg, AttemptKeys(attempt)
        deadline = time.monotonic() + cfg.rdzv_timeout
        told = False
        while True:
            nodes = {k: self.channel.read(keys.node_join(k)) for k in self.nodes.order}
            self._note_joins(nodes)
            missing = [k for k, v in nodes.items() if v is None]
            if not missing:
                break
            if not told and time.monotonic() > deadline - cfg.rdzv_timeout + 3:
                self.say(f"waiting up to {cfg.rdzv_timeout:g}s for node(s) {missing} to join")
                told = True
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"node(s) {missing} did not join within {cfg.rdzv_timeout:g}s; start their "
                    f"agents with --nnodes {cfg.nnodes} and the same --master-addr/--master-port/--rdzv-id"
                )
            self._sleep()
        for k in range(cfg.nnodes):  # out nodes whose agents came back
            if k not in nodes and (join := self.channel.read(keys.node_join(k))) is not None:
                self._note_joins({k: join})
                self.nodes, admitted = node_set.admit(self.nodes, k)
                if admitted:
                    nodes[k] = join
        return nodes

    def _note_joins(self, joins: dict[int, NodeJoin | None]) -> None:
        """The leader's wall time when it first read each node's join (for the plan's
        `clock_seen`): later than the join was written, which bounds that node's offset."""
        now = time.time()
        for k, join in joins.items():
            if join is not None and k != self.cfg.node_rank:
                self._join_seen.setdefault(k, now)

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
        self._executor = self._planner(attempt, self.plan, resume=False)
        self._save_record(attempt)
        self.events.emit(Event.NODE_SET, attempt=attempt, order=list(self.nodes.order),
                         out={k: v.value for k, v in self.nodes.out.items()})
        return self.plan

    def _reset_attempt(self) -> None:
        self.leases.reset()
        self._lost.clear()
        self._released.clear()
        self._leaving.clear()
        self._draining.clear()
        self._standbys.clear()
        self._standbys_seen = 0

    def _planner(self, attempt: int, plan: AttemptPlan, resume: bool) -> PlanExecutor | None:
        if not self.watch.in_place:
            return None
        cfg = self.cfg
        config = PlannerConfig(policy=Policy(cfg.on_fault), recovery_timeout=cfg.recovery_timeout,
                               stall_limit=max(60.0, 3 * cfg.node_timeout),
                               join_timeout=cfg.join_timeout)
        if resume and (ex := PlanExecutor.resume(self.channel, attempt, config, self.events.emit,
                                                 self.say)) is not None:
            return ex
        slots = {k: list(range(n.offset, n.offset + n.nproc)) for k, n in plan.nodes.items()}
        state = initial_state(attempt, plan.world_size, slots, self.budget)
        return PlanExecutor(self.channel, state, config, self.events.emit, self.say)

    def _save_record(self, attempt: int) -> None:
        self.channel.write(LEADER_RECORD, LeaderRecord(
            attempt=attempt, restarts_spent=self.budget.spent, nodes=self.nodes))

    # ---------------------------------------------------------------- each look
    def _duties(self, attempt: int) -> Outcome | None:
        """The leader's part of each look: leadership, standby nodes, leases, the planner,
        quarantines, the end."""
        ch, keys, watch = self.channel, AttemptKeys(attempt), self.watch
        if self.election is not None:
            self.election.check_held()
        for join in ch.entries(keys.standbys, self._standbys_seen):
            self._standbys_seen += 1
            if join is not None:  # None: forged, rejected
                self._standbys[join.node] = join.instance
        self._record_rejections()
        lost = self._check_leases(attempt)
        if lost is not None and self._below_least():
            self.say(f"fewer than the --nnodes minimum of {self.cfg.least} nodes are left: "
                     "restarting, to wait for nodes")
            return Outcome(Ending.FAULT, watch.publish_fault(lost, attempt))
        ex = self._executor
        if ex is not None and watch.resilient:
            quarantined = [k for k, why in self.nodes.out.items() if why == NodeOut.QUARANTINED]
            end = ex.look(self.watch.sup.max_step, sorted(self._lost), sorted(self._standbys),
                          quarantined)
            watch.busy = ex.state.busy
            deaths, ex.deaths = ex.deaths, []
            for death in deaths:
                self._blame(attempt, death)
            if end is not None:
                return Outcome(Ending.FAULT, watch.publish_fault(end.fault, attempt), end)
            if not ex.state.busy:  # not while a recovery still counts on the node
                self._send_off(attempt)
        elif lost is not None:
            return Outcome(Ending.FAULT, watch.publish_fault(lost, attempt))
        back = self._node_back(attempt)
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

    def _node_back(self, attempt: int) -> int | None:
        """A static job running short (fewer than --nnodes nodes: a lost or drained node's
        ranks were dropped, no spare could take them) whose out node's new agent joined this
        attempt (a recreated pod, `returning`): that node, which a restart takes back in
        (`node_set.admit`) without spending the restart budget. At most one look a second."""
        now = time.monotonic()
        plan = self.plan
        if (self.cfg.joins_freely or plan is None or len(plan.nodes) >= self.cfg.nnodes
                or now - self._back_looked < 1.0):
            return None
        self._back_looked = now
        keys = AttemptKeys(attempt)
        for k in range(self.cfg.nnodes):
            if k in plan.nodes or self.nodes.out.get(k) not in (NodeOut.LOST, NodeOut.DRAINED):
                continue
            if self.channel.read(keys.node_join(k)) is not None:
                return k
        return None

    def _record_rejections(self) -> None:
        """Newcomers refused at first contact for another secret (`control.auth`) are the
        job's events too: at most one read a second, on an unsigned channel (a refused
        agent cannot sign)."""
        now = time.monotonic()
        if now - self._rejections_read < 1.0:
            return
        self._rejections_read = now
        for rejection in Channel(self.channel.backend).entries(AUTH_REJECTIONS,
                                                               self._rejections_seen):
            self._rejections_seen += 1
            if rejection is None:
                continue
            self.events.emit(Event.AGENT_REJECTED, rejected_node=rejection.node,
                             host=rejection.host, reason=rejection.reason)
            self.say(f"refused an agent on {rejection.host}: {rejection.reason}")

    def _below_least(self) -> bool:
        """Elastic: the nodes left (standby nodes included) are fewer than MIN."""
        if not self.cfg.elastic:
            return False
        left = set(self.plan.nodes) - self._lost - self._released
        takers = set(self._standbys) - self._lost if self.cfg.spares_when_standing_by else set()
        return len(left) + len(takers) < self.cfg.least

    def _followers(self) -> dict[int, str]:
        """Every other agent of the attempt (planned nodes and standby nodes): its instance."""
        nodes = {k: n.instance for k, n in self.plan.nodes.items() if k != self.cfg.node_rank}
        nodes.update(self._standbys)
        return nodes

    def _check_leases(self, attempt: int) -> Fault | None:
        """Declare lost every agent whose lease has not moved for --node-timeout."""
        watched = {k: i for k, i in self._followers().items()
                   if k not in self._lost and k not in self._released}
        silences = self.leases.silent_many([agent_lease(k, i) for k, i in watched.items()],
                                           time.monotonic())
        first = None
        for k, silent in zip(watched, silences, strict=True):
            if silent <= self.cfg.node_timeout:
                continue
            if self.channel.read(AttemptKeys(attempt).node_released(k)):
                self._released.add(k)  # drained, then left on purpose
                continue
            fault = self._declare_lost(attempt, k, f"agent of node {k} silent for {silent:.1f}s")
            first = first or fault
        return first

    def _declare_lost(self, attempt: int, node: int, detail: str) -> Fault:
        self._lost.add(node)
        self.nodes = node_set.mark_out(self.nodes, node, NodeOut.LOST)
        self._save_record(attempt)
        self.events.emit(Event.NODE_LOST, attempt=attempt, lost_node=node, detail=detail)
        self.say(f"node {node} lost: {detail}")
        return Fault(kind=FaultKind.NODE_LOST, node=node, detail=detail)

    # ---------------------------------------------------------------- lemons
    def _blame(self, attempt: int, fault: Fault) -> None:
        """Count a fault against its node; quarantine the node when it has had too many."""
        if fault.node is None or fault.kind == FaultKind.NODE_LOST:
            return
        self.nodes, quarantined = node_set.blame(self.nodes, fault.node, fault.t or time.time(),
                                                 self.cfg.quarantine)
        self._save_record(attempt)
        if not quarantined:
            return
        rule = self.cfg.quarantine
        self.channel.write(node_out(fault.node), NodeOut.QUARANTINED)
        self.events.emit(Event.NODE_QUARANTINED, attempt=attempt, quarantined=fault.node,
                         faults=rule.after, window=rule.window)
        self.say(f"node {fault.node} quarantined: {rule.after} faults within {rule.window:g}s; "
                 "its ranks go to spares, and it is not used again")

    def _send_off(self, attempt: int) -> None:
        """Each quarantined node of the attempt, once the planner is idle: its ranks are
        drained onto ready spares (a standby node's first; if there are too few, the drain
        is refused and the node keeps them until the next full restart, which leaves it out);
        once it holds no rank, it is told to leave."""
        keys = AttemptKeys(attempt)
        for k, why in self.nodes.out.items():
            if why != NodeOut.QUARANTINED or k in self._leaving or k == self.cfg.node_rank \
                    or k in self._lost or k not in self._followers():
                continue
            if self.channel.read(keys.hosted(k)):
                if k not in self._draining:
                    self._draining.add(k)
                    self.channel.append(keys.drains, DrainRequest(kind=DrainKind.NODE, target=k))
                continue
            self._leaving.add(k)
            self.channel.append(keys.orders(k), NodeOrder(kind=OrderKind.LEAVE, slot=-1))

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
        if outcome.fault is not None and self._executor is None:
            self._blame(attempt, outcome.fault)
        self.watch.stop_workers(attempt, outcome.fault)
        self._wait_stopped(attempt)
        self._worker_store = None  # the last reference: the store closes its port
        self._next_node_set(attempt)

    def _next_node_set(self, attempt: int) -> None:
        """Who the next attempt waits for: drained nodes leave the order, and a standby node
        that took over an out node's ranks takes its place."""
        keys = AttemptKeys(attempt)
        for k in self._released:
            self.nodes = node_set.mark_out(self.nodes, k, NodeOut.DRAINED)
        layout = {k: list(range(n.offset, n.offset + n.nproc)) for k, n in self.plan.nodes.items()}
        hosted = {k: set((self.channel.read(keys.hosted(k)) or {}).values())
                  for k in set(self.plan.nodes) | set(self._standbys)}
        if self._executor is not None:  # a node that took a slot over is its heir, even if
            for slot, k in self._executor.promoted.items():  # that worker died since
                hosted.setdefault(k, set()).add(slot)
        self.nodes, heirs = node_set.after_attempt(self.nodes, layout, hosted)
        for out, heir in heirs.items():
            self.events.emit(Event.NODE_TAKEN_OVER, attempt=attempt, out_node=out, by=heir)
        self._save_record(attempt)

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

    def _fail(self, fault: Fault | None, reason: str,
              code: ExitCode = ExitCode.GAVE_UP) -> int:
        self.channel.write(RESULT, Result(Status.FAILED, fault=fault, reason=reason))
        self._report_failure(fault, reason)
        self._wait_acks()
        self._clear()
        return code

    def _stranded(self) -> bool:
        """A static job whose every node is out, with no standby node to take their ranks:
        the next attempt would wait for nobody, forever (a one-node job whose node was
        quarantined). Elastic jobs wait for newcomers, bounded by --rdzv-timeout."""
        if self.cfg.joins_freely or not node_set.nobody_left(self.nodes):
            return False
        return not (set(self._standbys) - self._lost - set(self.nodes.out))

    def _stranded_reason(self) -> str:
        rule = self.cfg.quarantine
        out = ", ".join(f"node {k} {why.value}" for k, why in sorted(self.nodes.out.items()))
        return (f"no node is left to train on ({out}; quarantine: {rule.after} faults within "
                f"{rule.window:g}s), and no standby node can take the ranks; exit "
                f"{int(ExitCode.QUARANTINED)}: run the job on other machines, or raise "
                "--quarantine-after (0 turns quarantine off)")

    def _clear(self) -> None:
        """With etcd, the job's keys outlive it: delete them once every follower has read
        the result (the TCPStore goes away with this agent)."""
        if self.election is not None:
            self.channel.backend.delete_prefix()

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
        others = (set(plan.nodes) | set(self._standbys)) - self._lost - self._released - {me}
        if mine is None or not others:
            return False
        ready = self.channel.read_many([keys.ready_spares(k) for k in sorted(others)])
        if sum(len(r or []) for r in ready) < mine.nproc:
            return False
        self._stepping_down = True
        self.events.emit(Event.LEADER_STEPPED_DOWN, attempt=plan.attempt, ranks=mine.nproc)
        self.say("SIGTERM: stepping down; another agent takes over and moves this node's "
                 "ranks to spares")
        return True

    def interrupted(self, signum: int, held_ranks: bool = True) -> None:
        if self._stepping_down:
            return  # no result: the job goes on under the next leader
        self.channel.write(RESULT, Result(Status.INTERRUPTED, signal=signum))
        self._wait_acks()
