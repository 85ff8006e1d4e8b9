"""The agents' events about the job: its start, rendezvous, attempts, nodes, leadership and
control plane. (Faults and their recovery: `schema.recovery`.)"""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event, optional

SECTION = "Agent events"


@event(Event.AGENT_START)
class AgentStart(EventBody):
    """An agent started."""

    run_id: str = doc("the job's id (--rdzv-id)")
    pid: int = doc("the agent's process id")
    nnodes: str | int = doc("--nnodes as given (`MIN:MAX` where elastic)")
    nproc_per_node: int = doc("workers per node")
    max_restarts: int = doc("--max-restarts")
    script: str = doc("the training script")
    args: list[str] = doc("the script's arguments")
    faults: str | None = doc("the faults to inject (--faults), or null")
    instance: str = doc("the agent's instance id: a restarted agent is a new instance")


@event(Event.HEALTH_CHECKED)
class HealthChecked(EventBody):
    """An agent checked its node before it joined (`--health-check`)."""

    mode: str = doc("`quick` or `full`")
    checks: list[dict] = doc("each check: `name`, `ok`, `detail`, `seconds`, in order; a "
                             "failed one ends the list")
    refused: str | None = doc("the one line of a failed check (the agent exits 4), or null")


@event(Event.RENDEZVOUS)
class Rendezvous(EventBody):
    """Leader only: an attempt's nodes were gathered and its plan published."""

    attempt: int | None = doc("the attempt")
    world_size: int = doc("ranks in the attempt")
    duration: float = doc("opening the attempt to publishing its plan")
    worker_port: int = doc("the attempt's fresh store")
    nodes: list[int] | None = optional("the nodes in the plan")


@event(Event.CLOCK_OFFSET)
class ClockOffset(EventBody):
    """Measured at each rendezvous this node takes part in, with no extra round trip: the
    join's send time, the leader's times of reading it and of writing the plan, and the time
    the plan was read bound the offset. The leader writes `offset` 0, `error` 0 for its own
    node. None is written when the bounds cross (a clock was stepped between the join and
    the plan), nor by a standby node or an agent standing by outside the plan. `unbroken
    report` moves each node's events by its latest `offset`."""

    attempt: int | None = doc("the attempt")
    offset: float = doc("seconds to add to this node's `t` to get the leader's clock: the "
                        "bounds' midpoint")
    error: float = doc("the offset is within ± this: half the bounds' width")


@event(Event.WORKERS_STARTED)
class WorkersStarted(EventBody):
    """This node's workers of an attempt were started."""

    attempt: int | None = doc("the attempt")
    duration: float = doc("seconds to start them")
    pids: dict[str, int] = doc("rank → pid")


@event(Event.WARM_STARTED)
class WarmInterpretersStarted(EventBody):
    """Warm interpreters were started for the next attempt (before the fork server: read in
    older runs' logs, no longer written; older logs: `standbys_started`)."""

    count: int = doc("how many")


@event(Event.FORK_SERVER_LOST)
class ForkServerLost(EventBody):
    """The node's fork server died (its workers are the agent's and run on): a new one
    starts, or, the second time, the job's workers start as fresh interpreters."""

    pid: int = doc("the server's pid")
    error: str = doc("what the agent saw")
    restarted: bool = doc("whether a new server was started")


@event(Event.WORKERS_STOPPED)
class WorkersStopped(EventBody):
    """This node's workers were stopped (the attempt ended)."""

    attempt: int | None = doc("the attempt")
    duration: float = doc("SIGTERM to all reaped")
    reason: str | None = doc("the fault kind that ended the attempt, or null")


@event(Event.WORKERS_DONE)
class WorkersDone(EventBody):
    """This node's workers all exited 0."""

    attempt: int | None = doc("the attempt")


@event(Event.RESTART)
class Restart(EventBody):
    """Leader only: every worker restarts, as a new attempt."""

    attempt: int | None = doc("the new attempt")
    restarts_left: int | None = doc("restarts the budget still allows")
    reason: str | None = doc("the fault kind that caused it, or null")


@event(Event.NOTICE)
class Notice(EventBody):
    """The agent was told to stop (a pod deletion, an eviction, a spot reclaim); while its
    workers train in place it first asks for its ranks to move to ready spares (a drain of its
    node), and leaves once they have, within `grace`; otherwise it stops its workers as for
    any signal."""

    signal: str = doc("`SIGTERM`")
    grace: float = doc("--shutdown-timeout")


@event(Event.NODE_DRAINED)
class NodeDrained(EventBody):
    """A follower whose every rank was drained: its agent leaves the job."""

    attempt: int | None = doc("the attempt")


@event(Event.CONTROL_UNSIGNED)
class ControlUnsigned(EventBody):
    """This agent has no secret, on a multi-node job given none: the job's control messages
    are not signed (one line says how to sign them)."""


@event(Event.DEAD_JOB_FOUND)
class DeadJobFound(EventBody):
    """An etcd agent at first contact: the keys under its --rdzv-id were a dead job's (no
    leader alive, `launch/dead_job.py`); without --continue-dead-job it exits 2 saying so."""

    silent: float = doc("seconds it watched")
    cont: bool = doc("whether --continue-dead-job was given")


@event(Event.DEAD_JOB_CLEARED)
class DeadJobCleared(EventBody):
    """The one agent that cleared a dead job's keys (--continue-dead-job); the job then forms
    afresh under the same id."""


@event(Event.NODE_RETURNED)
class NodeReturned(EventBody):
    """An agent that started while the job went on without its node (a recreated pod,
    `launch/returning.py`)."""

    returned_node: int = doc("the node it was")
    standby_node: int = doc("the standby id it joins under")


@event(Event.AGENT_REJECTED)
class AgentRejected(EventBody):
    """An agent whose secret differs from the job's (or that has none while the job signs, or
    one while it does not) left at first contact with exit 2; the job went on."""

    reason: str = doc("why")
    host: str = doc("its host")
    rejected_node: int | None = optional("the leader's record: the newcomer's node, from its "
                                         "word in the store")


@event(Event.FORGED_MESSAGE)
class ForgedMessage(EventBody):
    """A control message whose signature is missing or wrong (written by someone without the
    job's secret); it was rejected and nothing acted on it (agents and workers)."""

    key: str = doc("the message's key")
    reason: str = doc("why it was rejected")


@event(Event.LEASE_LOST)
class LeaseLost(EventBody):
    """An agent's liveness lease could not be refreshed for the whole
    `--control-retry-window`; the main loop fails on its next store call."""

    error: str = doc("the last error")


@event(Event.CONTROL_PLANE_LOST)
class ControlPlaneLost(EventBody):
    """An agent or a worker: a call to the control plane failed; it is retried with backoff
    for `--control-retry-window` seconds (a blip, not a fault)."""

    error: str = doc("the error")


@event(Event.CONTROL_PLANE_BACK)
class ControlPlaneBack(EventBody):
    """An agent or a worker: the control plane answered again."""

    outage: float = doc("seconds until it answered")


@event(Event.LEADER_ELECTED)
class LeaderElected(EventBody):
    """The agent that took over leadership (etcd)."""

    attempt: int | None = doc("the attempt")
    term: int = doc("its term")
    previous: int | None = doc("the old leader's node, or null")
    handed: bool = doc("the old leader handed the lead over (a drain of its node) rather "
                       "than going silent", default=False)


@event(Event.LEAD_HANDED_OVER)
class LeadHandedOver(EventBody):
    """A leader on etcd asked to drain its own node: it hands the lead to another agent (a
    compare-and-set of the claim, so a deposed leader cannot) and goes on as a follower with
    its workers training; the new leader carries the drain out."""

    attempt: int = doc("the attempt")
    to: int = doc("the node that leads from now on")
    term: int = doc("the new leader's term")


@event(Event.LEAD_HANDOVER_BLOCKED)
class LeadHandoverBlocked(EventBody):
    """A leader asked to drain its own node could not hand the lead to the heir its planner
    named (not expected: the planner names a node that runs ranks); the drain stays held
    and the handover is tried again at each look."""

    attempt: int = doc("the attempt")
    to: int = doc("the heir")
    reason: str = doc("why not")


@event(Event.LEADER_STEPPED_DOWN)
class LeaderSteppedDown(EventBody):
    """A leader on etcd that took SIGTERM as a notice (a pod deletion): it stops its workers
    and exits 143 with no result written, and another agent takes over and moves the ranks in
    place."""

    attempt: int | None = doc("the attempt")
    ranks: int = doc("its own ranks, which ready spares elsewhere can take")


@event(Event.LEADER_DEPOSED)
class LeaderDeposed(EventBody):
    """An agent that led and found its claim taken, or whose write was refused because it
    no longer held it (fenced: it was cut off or paused past `--leader-timeout`); it stops
    its workers and exits 3."""

    error: str = doc("what it found")


@event(Event.NODE_SET)
class NodeSet(EventBody):
    """The leader, at each attempt's plan."""

    attempt: int | None = doc("the attempt")
    order: list[int] = doc("the nodes holding ranks, in rank order")
    out: dict[str, str] = doc("node → lost, drained or quarantined")


@event(Event.NODE_TAKEN_OVER)
class NodeTakenOver(EventBody):
    """The leader, after an attempt: a standby node holds an out node's ranks from now on."""

    attempt: int | None = doc("the attempt")
    out_node: int = doc("the node out of the job")
    by: int = doc("the standby node that holds its ranks from now on")


@event(Event.NODE_QUARANTINED)
class NodeQuarantined(EventBody):
    """A node had `faults` faults within `window` seconds; its ranks go to spares and it is
    not used again. Written by the leader (all fields) and by the quarantined node's agent
    (`quarantined` only)."""

    quarantined: int = doc("the quarantined node")
    faults: int | None = optional("the leader: faults it had")
    window: float | None = optional("the leader: within this many seconds")


@event(Event.AGENT_ERROR)
class AgentError(EventBody):
    """The control plane failed."""

    error: str = doc("the error")


@event(Event.AGENT_EXIT)
class AgentExit(EventBody):
    """The agent exits."""

    code: int = doc("the agent's exit code")
    events_dropped: int = doc("events this agent could not write to the log (a full disk)")


@event(Event.EVENTS_DROPPED)
class EventsDropped(EventBody):
    """Written when a writer (agent, fork server or worker) closes its log, if it had to drop
    events it could not write (a full disk); missing if it still cannot be written."""

    dropped: int = doc("events dropped")


