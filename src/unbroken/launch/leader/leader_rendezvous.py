"""The leader's rendezvous of each attempt: which nodes' agents it waits for, and which it
admits, before it plans the attempt (`Leader._make_plan`).

A static job waits for every node of the job's node set (lost, drained and quarantined nodes
are out of it); a node whose agent came back is admitted again. An elastic one
(`--nnodes MIN:MAX`) gathers whoever joined, by `node_set.gather`. What this learns about
nodes goes into the leader's one `PlannerState` (`node_life`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from unbroken.control.messages import NodeJoin, NodeOut
from unbroken.control.schema import NODE_RANKS, AttemptKeys, agent_lease
from unbroken.errors import ControlPlaneError
from unbroken.launch.planning import node_life, node_set
from unbroken.polling import poll_until

_LOOK = 0.02  # seconds between two looks while waiting: the role's sleep (the agent's default)

if TYPE_CHECKING:
    from unbroken.control.channel import Channel
    from unbroken.control.messages import AttemptPlan, NodeSet
    from unbroken.launch.config import LaunchConfig
    from unbroken.launch.leader.leader_followers import Followers
    from unbroken.launch.leader.plan_executor import PlanExecutor
    from unbroken.launch.planning.planner_state import PlannerState


class Lead(Protocol):
    """What the rendezvous uses of its leader (`leader.Leader`, which makes it): declared
    here, so that the rendezvous never imports the leader back."""

    cfg: LaunchConfig
    channel: Channel
    state: PlannerState
    nodes: NodeSet
    plan: AttemptPlan | None
    followers: Followers
    _executor: PlanExecutor

    def say(self, msg: str) -> None: ...

    _sleep: Callable[[], None]

    def save_record(self, attempt: int) -> None: ...


class Rendezvous:
    """The leader's side of each attempt's rendezvous."""

    def __init__(self, lead: Lead) -> None:
        self.lead = lead
        self.join_seen: dict[int, float] = {}  # node -> wall time its join was first read
        self._back_looked = 0.0  # monotonic time of the last look for returned nodes

    def _gathered(self, attempt: int) -> dict[int, NodeJoin]:
        """Elastic (`--nnodes MIN:MAX`, or ranks in join order): the nodes `node_set.gather`
        picks from the agents that joined; agents beyond the cap stand by this attempt."""
        cfg, keys, ch = self.lead.cfg, AttemptKeys(attempt), self.lead.channel
        rule = node_set.Gathering(least=cfg.least, cap=cfg.cap, last_call=cfg.last_call)
        # The last attempt's standing-by nodes are on their way to rejoin: a restart admits them.
        stood_by = ch.entries(AttemptKeys(attempt - 1).standbys, 0) if attempt else []
        expected = tuple(sorted({j.node for j in stood_by if j is not None}
                                - set(self.lead.state.nodes.lost)))
        t0 = time.monotonic()
        enough_at: float | None = None
        told = False
        while True:
            known = list(range(ch.count(NODE_RANKS) + 1))  # every rank handed out so far
            joins = dict(zip(known, ch.read_many([keys.node_join(k) for k in known]), strict=True))
            joined = {k: j for k, j in joins.items() if j is not None}
            self._note_joins(joined)
            now = time.monotonic()
            gathered, enough = node_set.gather(self.lead.nodes, list(joined), cfg.node_rank, rule,
                                               attempt, None if enough_at is None else now - enough_at,
                                               expected)
            if gathered is not None:
                break
            self._lose_silent_members(attempt, set(joined))
            if enough and enough_at is None:
                enough_at = now
                self.lead.say(f"{len(joined)} node(s) joined (at least {cfg.least}); waiting up to "
                         f"{cfg.last_call:g}s for more, up to {cfg.cap}")
            if not told and not enough and now - t0 > 3:
                self.lead.say(f"{len(joined)} node(s) joined; waiting up to {cfg.rdzv_timeout:g}s "
                         f"for at least {cfg.least}")
                told = True
            if now - t0 > cfg.rdzv_timeout:
                missing = [k for k in self.lead.nodes.order if k not in self.lead.nodes.out
                           and k not in joined]
                raise ControlPlaneError(
                    f"only {len(joined)} node(s) joined within {cfg.rdzv_timeout:g}s, fewer than "
                    f"the --nnodes minimum of {cfg.least}; start more agents with the same "
                    "--rdzv-endpoint/--rdzv-id, or lower MIN" if len(joined) < cfg.least else
                    f"node(s) {missing} of the last attempt did not rejoin within "
                    f"{cfg.rdzv_timeout:g}s though their agents are alive")
            self.lead._sleep()
        self.lead.nodes = gathered
        return {k: joined[k] for k in gathered.order}

    def _lose_silent_members(self, attempt: int, joined: set[int]) -> None:
        """While an elastic rendezvous waits for the last attempt's nodes: one whose agent
        went silent since (it died between attempts) is lost, not waited for."""
        if self.lead.plan is None:
            return
        waited = {k: n.instance for k, n in self.lead.plan.nodes.items()
                  if k in self.lead.nodes.order and k not in self.lead.nodes.out and k not in joined}
        silences = self.lead.followers.leases.silent_many([agent_lease(k, i) for k, i in waited.items()],
                                           time.monotonic())
        for k, silent in zip(waited, silences, strict=True):
            if silent > self.lead.cfg.node_timeout:
                self.declare_lost(attempt, k, f"agent of node {k} silent for {silent:.1f}s "
                                   "while the next attempt gathered")

    def wait_joined(self, attempt: int) -> dict[int, NodeJoin]:
        """Wait for every node of the node set (lost, drained and quarantined nodes are not
        waited for); a node that comes back by then is admitted too."""
        if self.lead.cfg.joins_freely:
            return self._gathered(attempt)
        cfg, keys = self.lead.cfg, AttemptKeys(attempt)
        missing: list[int] = []
        told = False

        def all_joined() -> dict[int, NodeJoin | None] | None:
            nonlocal missing
            nodes = {k: self.lead.channel.read(keys.node_join(k)) for k in self.lead.nodes.order}
            self._note_joins(nodes)
            missing = [k for k, v in nodes.items() if v is None]
            return None if missing else nodes

        def tell(waited: float) -> None:
            nonlocal told
            if not told and waited > 3:
                self.lead.say(f"waiting up to {cfg.rdzv_timeout:g}s for node(s) {missing} to join")
                told = True

        nodes = poll_until(
            all_joined, cfg.rdzv_timeout, _LOOK, on_wait=tell, sleep=lambda _: self.lead._sleep(),
            timeout_error=lambda: ControlPlaneError(
                f"node(s) {missing} did not join within {cfg.rdzv_timeout:g}s; start their "
                f"agents with --nnodes {cfg.nnodes} and the same --master-addr/--master-port/--rdzv-id"))
        for k in range(cfg.nnodes):  # out nodes whose agents came back
            if k not in nodes and (join := self.lead.channel.read(keys.node_join(k))) is not None:
                self._note_joins({k: join})
                job, admitted = node_set.admit(self.lead.nodes, k)
                self.lead.nodes = job
                if admitted:
                    nodes[k] = join
        return nodes

    def _note_joins(self, joins: dict[int, NodeJoin | None]) -> None:
        """The leader's wall time when it first read each node's join (for the plan's
        `clock_seen`): later than the join was written, which bounds that node's offset."""
        now = time.time()
        for k, join in joins.items():
            if join is not None and k != self.lead.cfg.node_rank:
                self.join_seen.setdefault(k, now)

    def node_back(self, attempt: int) -> int | None:
        """A static job running short (fewer than --nnodes nodes: a lost or drained node's
        ranks were dropped, no spare could take them) whose out node's new agent joined this
        attempt (a recreated pod, `returning`): that node, which a restart takes back in
        (`node_set.admit`) without spending the restart budget. At most one look a second."""
        now = time.monotonic()
        plan = self.lead.plan
        if (self.lead.cfg.joins_freely or plan is None or len(plan.nodes) >= self.lead.cfg.nnodes
                or now - self._back_looked < 1.0):
            return None
        self._back_looked = now
        keys = AttemptKeys(attempt)
        for k in range(self.lead.cfg.nnodes):
            if k in plan.nodes or self.lead.nodes.out.get(k) not in (NodeOut.LOST, NodeOut.DRAINED):
                continue
            if self.lead.channel.read(keys.node_join(k)) is not None:
                return k
        return None

    def declare_lost(self, attempt: int, node: int, detail: str) -> None:
        self.lead.state.nodes, said = node_life.declare_lost(self.lead.state.nodes, node, attempt,
                                                             detail)
        self.lead._executor.carry_out(said)
        self.lead.save_record(attempt)

