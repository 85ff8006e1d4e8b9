"""The planner's drains (`unbroken drain`), as pure functions of its state: which members a
request moves (or why it is refused), and the answer once the switch that moved them is up.

A drain moves each member of a rank or node onto a ready spare: the spare is promoted into
the member's slot, and the member gives its slot up at the switch that follows the spare's
join (`planner._settle`). The drain is answered once every rank it moved runs in the new
generation.

A drain of the leader's own node on etcd moves the lead first (`hold_for_lead`): the request
is held in the state, the leader hands the lead to the agent of another node that runs ranks
(`PlannerState.drains.lead_to`, carried out by `Leader`), and the next leader's planner takes
the held request up as a new one (`taken_up`). On the TCPStore the leader's node holds the
store: refused.
"""

from __future__ import annotations

from dataclasses import replace

from unbroken.control.messages import DrainKind, DrainOutcome, DrainRequest
from unbroken.launch.planning.planner_commands import AnswerDrain, Command, Record, Say
from unbroken.launch.planning.planner_state import Drains, Phase, PlannerConfig, PlannerState
from unbroken.telemetry import schema as ev
from unbroken.telemetry.event_names import Event


def movers(s: PlannerState, request: DrainRequest, hosted: dict[int, dict[str, int] | None],
           config: PlannerConfig) -> tuple[list[str], int | None] | str:
    """The members `request` moves, and the node they leave (None: a rank's drain); or why
    the request is refused."""
    if s.phase != Phase.RUNNING or s.switch_requested:
        return "a recovery or switch is in progress; try again in a moment"
    node = None
    if request.kind == DrainKind.NODE:
        node = request.target
        if node == config.leader_node:  # elected: `hold_for_lead` came first
            return (f"node {node} hosts the control store (the embedded TCPStore) and cannot "
                    "be drained; with --rdzv-backend etcd any node's agent can step down")
        on_node = hosted.get(node) or {}
        moving = [m for m in s.members if m in on_node]
    else:
        moving = [m for m in s.members if s.slot_of[m] == request.target]
    if not moving:
        return f"no member of generation {s.gen} is on {request.describe()}"
    if len(moving) >= len(s.members):
        return "a drain needs a member that stays to hand the state over"
    return moving, node


def hold_for_lead(s: PlannerState, index: int, request: DrainRequest,
                  hosted: dict[int, dict[str, int] | None],
                  config: PlannerConfig) -> tuple[Drains, list[Command]] | None:
    """A drain of the leader's own node, with an elected leader: hold it and name the node
    to lead instead (the lowest other node running members of the generation, whose agent
    is surely up). None when this is not such a drain. Refused when no such node exists."""
    if not (config.elected and request.kind == DrainKind.NODE
            and request.target == config.leader_node):
        return None
    if s.phase != Phase.RUNNING or s.switch_requested:
        return s.drains, refusal(index, request, "a recovery or switch is in progress; try "
                                 "again in a moment")
    gone = set(s.nodes.lost) | set(s.nodes.released) | set(s.nodes.quarantined)
    heirs = sorted(k for k, on in hosted.items() if k != config.leader_node and k not in gone
                   and any(m in s.members for m in on or {}))
    if not heirs:
        return s.drains, refusal(index, request, "no other node runs ranks of the job to take "
                                 "the lead; a drain needs a member that stays")
    drains = replace(s.drains, held={**s.drains.held, index: request}, lead_to=heirs[0])
    return drains, [Say(f"drain of node {request.target}, which leads: handing the lead to "
                        f"node {heirs[0]} first")]


def taken_up(drains: Drains, leader_node: int) -> tuple[Drains, list[tuple[int, DrainRequest]]]:
    """The held drains this planner's leader can now carry out (they drain another node
    than its own: the lead has moved), and the drains left held."""
    ready = sorted((i, r) for i, r in drains.held.items() if r.target != leader_node)
    if not ready:
        return drains, []
    held = {i: r for i, r in drains.held.items() if r.target == leader_node}
    return replace(drains, held=held, lead_to=drains.lead_to if held else None), ready


def refusal(index: int, request: DrainRequest, why: str) -> list[Command]:
    return [AnswerDrain(index, DrainOutcome(ok=False, error=why)),
            Record(ev.DrainRefused(request=request.as_event(), reason=why)),
            Say(f"drain refused: {why}")]


def answered(drains: Drains, slot_of: dict[str, int], gen: int,
             switch_s: float | None) -> tuple[Drains, list[Command]]:
    """Generation `gen` is up: record each move its switch made, and answer each drain whose
    every rank has moved."""
    out: list[Command] = []
    moves = {i: list(m) for i, m in drains.moves.items()}
    for member, spare, index in drains.moved:
        move = {"rank": slot_of[spare], "from": member, "to": spare}
        moves.setdefault(index, []).append(move)
        out.append(Record(ev.decode({"event": Event.DRAINED, **move, "gen": gen,
                                       "switch_s": switch_s})))
        out.append(Say(f"drained rank {move['rank']}: {member} -> {spare}, generation {gen} "
                       f"up {switch_s}s after the switch began"))
    for index in sorted({index for _, _, index in drains.moved}):
        if not any(i == index for _, i in drains.draining.values()):  # every rank moved
            out.append(AnswerDrain(index, DrainOutcome(
                ok=True, moves=moves.pop(index), gen=gen, switch_s=switch_s)))
    return replace(drains, moved=[], moves=moves), out
