"""The agents' events about faults and their recovery: faults, spares, drains, stalls and
the generations of in-place recovery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event, optional

SECTION = "Agent events: faults and recovery"


@dataclass(frozen=True, kw_only=True)
class FaultFields(EventBody):
    """The fields of a published fault (`control.messages.Fault.event_fields`)."""

    kind: str = doc("`crash`, `exit`, `exception`, `hang`, `node_lost`, `agent_stopped` or "
                    "`recovery_failed`")
    rank: int | None = doc("the global rank at attempt start (the slot); null: a node")
    node: int | None = doc("the node that hosted it (or the lost node)")
    detail: str | None = optional("what was seen")
    pid: int | None = optional("the process")
    step: int | None = optional("the last step its heartbeat showed")
    exit_code: int | None = optional("negative: the signal")
    traceback: str | None = optional("exceptions: the traceback")
    error_class: str | None = optional(
        "exceptions: `peer`, `own_device` or `user`, as `errors.classify` judged it in the "
        "worker")
    error_file: str | None = optional("the worker's error file (torchrun's error.json)")
    local_rank: int | None = optional("the worker's local rank")
    host: str | None = optional("the host")
    reported_by: int | None = optional("the node whose agent published it")
    in_place: bool | None = optional("true when the fault is recovered in place")
    wid: str | None = optional("in place: the worker id (`SLOT.INCARNATION`, or a spare's)")
    spare: str | None = optional("a hot spare (its wid) promoted into the slot")
    silent_for: float | None = optional("hangs: how long it was silent")
    hang_started: float | None = optional("hangs: when it went silent (wall time)")
    timeout: float | None = optional("hangs: the timeout used")


@event(Event.FAULT)
class Fault(FaultFields):
    """Written once per fault, by the agent that saw it first (an exception caught in place
    is written by the leader); `slot` is set when it is recovered in place."""


@event(Event.EXIT_AFTER_DONE)
class ExitAfterDone(FaultFields):
    """The `fault` fields of a worker that exited non-zero after it had finished training and
    reported done: not a fault, nothing is recovered."""


@event(Event.NODE_LOST)
class NodeLost(EventBody):
    """Leader only: a node was lost; also when the attempt's first fault was a survivor's
    error."""

    attempt: int | None = doc("the attempt")
    lost_node: int = doc("the node")
    detail: str = doc("what was seen")


@event(Event.SPARE_STARTED)
class SpareStarted(EventBody):
    """A hot spare, warming up at idle priority."""

    wid: str = doc("its worker id, `spare<NODE>-<N>`")
    pid: int = doc("its process id")


@event(Event.SPARES_OFFERED)
class SparesOffered(EventBody):
    """An agent published its node's ready spares (`ready/<node>`) when that list changed:
    from then on the leader's planner may assign them to another node's slots."""

    wids: list[str] = doc("the spares offered now (empty: none any more)")


@event(Event.SPARE_PROMOTED)
class SparePromoted(EventBody):
    """A ready spare takes a slot: the agent's record, and the worker's own when it sees it
    (`wid`, `slot`)."""

    wid: str = doc("the spare")
    pid: int | None = optional("the agent: its process id")
    by: str | None = optional("the agent: `agent` (its own node's death) or `leader` (asked "
                              "by the leader, for another node's death, a lost node or a "
                              "drain)")


@event(Event.SPARE_ASSIGNED)
class SpareAssigned(EventBody):
    """Leader: a ready spare of `spare_node` is asked to take the slot."""

    wid: str = doc("the spare")
    spare_node: int = doc("its node")


@event(Event.SPARE_REQUEST_DECLINED)
class SpareRequestDeclined(EventBody):
    """The leader asked for a spare that is no longer ready here."""

    wid: str = doc("the spare")


@event(Event.SPARE_LOST)
class SpareLost(EventBody):
    """A spare died (while warming up or waiting); another is started."""

    wid: str = doc("the spare")
    exit_code: int | None = doc("its exit code")
    detail: str = doc("what was seen")


@event(Event.DRAIN_STARTED)
class DrainStarted(EventBody):
    """Leader: ranks move to ready spares."""

    request: dict[str, int] = doc('`{"slot": R}` or `{"node": K}`')
    moves: dict[str, str] = doc("slot → spare wid")


@event(Event.DRAIN_REFUSED)
class DrainRefused(EventBody):
    """Leader: a drain was refused."""

    request: dict[str, int] = doc('`{"slot": R}` or `{"node": K}`')
    reason: str = doc("e.g. not enough ready spares, node 0, a recovery in progress")


@event(Event.DRAINED)
class Drained(EventBody):
    """A rank moved to a spare. The leader writes `rank`, `from`, `to`, `gen`, `switch_s`; the
    drained worker writes its own, with `slot`, `step`, `pid`, and exits 0."""

    from_: str | None = doc("the leader: the worker that left", None, key="from")
    to: str | None = optional("the leader: the spare that took its place")
    gen: int | None = optional("the leader: the generation it joined")
    switch_s: float | None = optional("the leader: first member leaving → the generation up")
    step: int | None = optional("the worker: its step")
    pid: int | None = optional("the worker: its process id")


@event(Event.REPLACEMENT_STARTED)
class ReplacementStarted(EventBody):
    """In place: a replacement for a dead worker, which joins at a step boundary."""

    wid: str = doc("worker id `SLOT.INCARNATION`")
    pid: int = doc("its process id")
    duration: float = doc("seconds to start it")


@event(Event.DEPARTURES_SENT)
class DeparturesSent(EventBody):
    """An agent, in place: its workers that left a generation, sent to the planner in one
    write (`launch/workers/departure_relay.py`)."""

    gen: int = doc("the generation they left")
    wids: list[str] = doc("the workers, in the order they posted")
    waited: float = doc("seconds from the first one's post to the write")


@event(Event.STALL_REPORTED)
class StallReported(EventBody):
    """An agent, in place: its workers stalled (`workers: []` when they move again)."""

    gen: int = doc("the generation")
    workers: list[dict[str, Any]] = doc(
        "each stalled worker: `wid`, `slot`, `step`, `progress` (points passed inside the "
        "step), `phase`, `silent_for`, `frozen_for` (seconds since its watchdog thread ran), "
        "`stopped` (state `T` in /proc), `timeout`")


@event(Event.STALL)
class Stall(EventBody):
    """Leader, in place: its verdict on a stall."""

    gen: int = doc("the generation")
    verdict: str = doc("`excused`: a member is in a declared long phase, a checkpoint or a "
                       "recovery; `wait`: not every member is reported yet, or one moves again; "
                       "`stuck`: all alive at the same point, no single culprit: a full restart")
    reason: str = doc("why")


@event(Event.HANG_BLAMED)
class HangBlamed(EventBody):
    """Leader, in place: the culprit's node is ordered to kill it, and its death is the
    `fault` (`kind: hang`)."""

    gen: int = doc("the generation")
    wid: str = doc("the culprit")
    culprit_node: int = doc("its node")
    step: int | None = doc("its step")
    progress: int | None = doc("points it passed inside the step")
    reason: str = doc("stopped, or behind the others")
    reports: int = doc("nodes that reported")


@event(Event.GEN_PLAN)
class GenPlan(EventBody):
    """Leader, in place: a generation is planned."""

    gen: int = doc("the generation")
    world_size: int = doc("its size")
    members: list[str] = doc("worker ids in rank order")
    duration: float | None = doc("from the moment the generation broke to the plan")


@event(Event.GEN_UP)
class GenUp(EventBody):
    """Leader, in place: every member of a generation switched and rebuilt."""

    gen: int = doc("the generation")
    world_size: int = doc("its size")
    duration: float | None = doc("generation broke → every member switched and rebuilt")
    faults: list[str] = doc("kinds recovered; empty for a planned grow-back")


@event(Event.RECOVERY_FALLBACK)
class RecoveryFallback(EventBody):
    """Leader: in-place recovery was impossible or too slow; every worker restarts from the
    last checkpoint."""

    gen: int | None = doc("the generation")
    reason: str = doc("why")
