"""Node lifecycle, as pure functions of the `Nodes` record (the `nodes` of `PlannerState`).

A node of the job is planned (its agent joined the attempt), or stands by (`--extra-nodes
standby`: its agent joined the standby queue, every process a spare). It leaves an attempt
in one of three ways, each kept here and nowhere else:

- lost: its agent's lease did not move for `--node-timeout` (a lease silence), or it was
  the leader a successor took over from;
- released: it was drained and left on purpose (its `released` key), so its silence is no
  loss;
- quarantined: `QuarantineRule.after` strikes (faults counted against it) within the
  window; it gets no replacement, gives no spare, and is never used again in this job.

Lost, drained and quarantined nodes are out of the job's `NodeSet` too (`node_set.py`), which
outlives the attempt: the leader persists it in `LeaderRecord` for a successor.

The planner (`planner.decide`) applies these to the lease silences, standby arrivals and
strikes of its inbox; the leader applies the same functions between attempts (while the
next attempt gathers, or while the last one stops), when no planner runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from unbroken.control.messages import NodeOut, NodeSet, StandbyJoin
from unbroken.launch.planning import node_set
from unbroken.launch.planning.node_set import QuarantineRule
from unbroken.launch.planning.planner_commands import Command, MarkOut, Record, Say
from unbroken.telemetry import schema as ev


@dataclass(frozen=True)
class Strike:
    """A fault counted against `node` (at wall time `t`) towards its quarantine."""

    node: int
    t: float


@dataclass(frozen=True)
class Nodes:
    """The job's nodes and what became of them. Replaced whole by the functions below;
    its containers are never changed in place outside `decide`'s private copy."""

    job: NodeSet
    """The job's node set: who a full restart waits for, who is out and why, the strikes."""
    planned: list[int] = field(default_factory=list)
    """The attempt's planned nodes."""
    layout: dict[int, list[int]] = field(default_factory=dict)
    """Node -> the slots it started the attempt with."""
    lost: list[int] = field(default_factory=list)
    """Nodes of this attempt declared lost."""
    released: list[int] = field(default_factory=list)
    """Nodes of this attempt drained and gone on purpose."""
    standby: dict[int, str] = field(default_factory=dict)
    """Standby nodes of this attempt -> their agent's instance."""

    @property
    def quarantined(self) -> list[int]:
        return sorted(k for k, why in self.job.out.items() if why == NodeOut.QUARANTINED)

    def gone(self, node: int) -> bool:
        """Lost or released: nobody waits for it any longer."""
        return node in self.lost or node in self.released


def for_attempt(nodes: Nodes, planned: list[int], layout: dict[int, list[int]]) -> Nodes:
    """A new attempt: the job's node set carries over, the attempt's own lists start empty."""
    return Nodes(job=nodes.job, planned=list(planned), layout=dict(layout))


def with_job(nodes: Nodes, job: NodeSet) -> Nodes:
    return replace(nodes, job=job)


def stand_by(nodes: Nodes, join: StandbyJoin) -> Nodes:
    """A standby node's agent joined the attempt."""
    return replace(nodes, standby={**nodes.standby, join.node: join.instance})


def release(nodes: Nodes, node: int) -> Nodes:
    """A drained node left on purpose (it is out of the next attempt: `drained_out`)."""
    return nodes if node in nodes.released else replace(nodes, released=[*nodes.released, node])


def lose(nodes: Nodes, node: int) -> Nodes:
    """`node` is lost: out of this attempt and of the job's node set (until it returns)."""
    lost = nodes.lost if node in nodes.lost else [*nodes.lost, node]
    return replace(nodes, lost=lost, job=node_set.mark_out(nodes.job, node, NodeOut.LOST))


def declare_lost(nodes: Nodes, node: int, attempt: int, detail: str) -> tuple[Nodes, list[Command]]:
    """`lose`, with the event and the line that say so."""
    return lose(nodes, node), [
        Record(ev.NodeLost(attempt=attempt, lost_node=node, detail=detail)),
        Say(f"node {node} lost: {detail}")]


def silences(nodes: Nodes, silent: dict[int, float], released: list[int], timeout: float,
             attempt: int) -> tuple[Nodes, list[Command], dict[int, str]]:
    """Take in lease silences (node -> seconds its agent's lease has not moved): a node
    silent past `timeout` is released if it said it left on purpose (`released`), else
    lost. Returns the record, what to say, and the newly lost nodes with why."""
    out: list[Command] = []
    lost: dict[int, str] = {}
    for node, seconds in silent.items():
        if seconds <= timeout or nodes.gone(node):
            continue
        if node in released:
            nodes = release(nodes, node)
            continue
        lost[node] = f"agent of node {node} silent for {seconds:.1f}s"
        nodes, said = declare_lost(nodes, node, attempt, lost[node])
        out += said
    return nodes, out, lost


def news(nodes: Nodes, silent: dict[int, float], timeout: float) -> bool:
    """Whether `silences` would change anything (the executor skips a look with no news)."""
    return any(s > timeout and not nodes.gone(k) for k, s in silent.items())


def strike(nodes: Nodes, hit: Strike, rule: QuarantineRule,
           attempt: int) -> tuple[Nodes, list[Command], bool]:
    """Count a strike against its node; quarantine the node on the strike that makes too
    many. Returns the record, what to do (tell the node, record, say), and whether this
    strike quarantined it."""
    job, quarantined = node_set.strike(nodes.job, hit.node, hit.t, rule)
    nodes = replace(nodes, job=job)
    if not quarantined:
        return nodes, [], False
    return nodes, [
        MarkOut(hit.node, NodeOut.QUARANTINED),
        Record(ev.NodeQuarantined(attempt=attempt, quarantined=hit.node,
                                  faults=rule.after, window=rule.window)),
        Say(f"node {hit.node} quarantined: {rule.after} faults within {rule.window:g}s; "
            "its ranks go to spares, and it is not used again")], True


def below_least(nodes: Nodes, least: int, standby_takes_ranks: bool) -> bool:
    """Elastic (`least` > 0): the nodes left, standby nodes that take ranks included, are
    fewer than MIN."""
    if not least:
        return False
    left = set(nodes.planned) - set(nodes.lost) - set(nodes.released)
    takers = set(nodes.standby) - set(nodes.lost) if standby_takes_ranks else set()
    return len(left) + len(takers) < least


def drained_out(nodes: Nodes) -> Nodes:
    """At the end of an attempt: its released nodes are out of the job (drained)."""
    job = nodes.job
    for k in nodes.released:
        job = node_set.mark_out(job, k, NodeOut.DRAINED)
    return replace(nodes, job=job)


def stranded(nodes: Nodes) -> bool:
    """Every node of the order is out, and no live standby node can take the ranks."""
    return node_set.nobody_left(nodes.job) and not (
        set(nodes.standby) - set(nodes.lost) - set(nodes.job.out))


def losing(nodes: Nodes, silent: dict[int, float], released: list[int], timeout: float,
           predecessor: int | None = None) -> list[int]:
    """The nodes `silences` (and a successor's predecessor) would declare lost."""
    lost = [k for k, s in silent.items()
            if s > timeout and not nodes.gone(k) and k not in released]
    if predecessor is not None and not nodes.gone(predecessor) and predecessor not in lost:
        lost.append(predecessor)
    return lost
