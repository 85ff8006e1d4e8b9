"""Goodput accounting: every second of every rank's wall time, charged to one category.

`account(events)` is a pure function of a run's events (`read_events`, every node's merged),
each read as its typed event (`telemetry.schema`).
It builds, for each rank slot, labelled intervals from what the events say happened (a step
ran from `t - duration` to `t`, a checkpoint load took `duration`, a fault's recovery ran
from the fault to that rank's next step, ...), each with a priority, and sweeps them: every
instant of `[job start, job end]` goes to the highest-priority label covering it, and an
instant no label covers is `idle`. So the categories of each rank sum to the wall time by
construction, and the figures are checked against the events, not against themselves.

What each category means is in `telemetry.categories`; the rules that decide it are the
`intervals.PRIORITY` table and `_labels_for_slot` below (`_plain_segments` for a script that reports
no steps: its running time is `untracked`), and docs/goodput.md states them for users.

A rank here is a *slot*: the rank a worker holds in the job's full world. A spare's warm-up
is not charged to any slot (it is extra capacity), but once promoted it carries its slot.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from unbroken.telemetry import schema as ev
from unbroken.telemetry.categories import BADPUT, Category
from unbroken.telemetry.intervals import Label, Segment, sweep
from unbroken.telemetry.schema import EventBody
from unbroken.telemetry.watched_steps import Watched, watched
from unbroken.telemetry.watched_steps import summary as watched_summary

STRAGGLER_FACTOR = 3.0
STRAGGLER_FLOOR_S = 0.25
"""A step slower than STRAGGLER_FACTOR times the run's median step, and slower than the
median by STRAGGLER_FLOOR_S at least (a hiccup of a few milliseconds is jitter, not a
straggler), is a straggler's; its time beyond the median is charged to `straggler`. The
first step after a (re)start or a generation switch is a warm-up, never a straggler."""

DATA_PHASES = ("data_loading", "data")
"""`run.phase(name)` names whose time is charged to `data_loading`."""

@dataclass
class _Step:
    slot: int
    rank: int
    attempt: int
    gen: int
    step: int
    start: float
    end: float
    loss: float | None
    redone: bool = False
    numbered: bool = True
    """Its `step` is the job's (false: an unchanged script's attempt whose resume step is
    unknown; its count is its own, never matched to another attempt's)."""


@dataclass(frozen=True)
class SeenFault:
    """One fault of the run (`distinct_faults`): its last `fault` event, when it happened
    (`began`: its injection, a hang's last heartbeat, else its detection) and when it was
    first detected (`t`)."""

    event: ev.Fault
    began: float
    t: float
    injected: bool = False
    """Injected by `UNBROKEN_FAULTS` (a `fault_injected` event): a cost, never a rate."""


def _worker(e: EventBody) -> bool:
    return e.source == "worker" and isinstance(e.slot, int) and e.slot >= 0


def _attempt(e: EventBody) -> int:
    return e.attempt if e.attempt is not None else 0


def _steps(events: list[EventBody], seen: Watched) -> list[_Step]:
    """The steps the workers reported, and the watched scripts' (`watched_steps`) on the
    slots that reported none; each computation later computed again is `redone`."""
    steps = [_Step(slot=e.slot, rank=e.rank if e.rank is not None else e.slot,
                   attempt=_attempt(e), gen=e.gen if e.gen is not None else 0, step=e.step,
                   start=e.t - e.duration, end=e.t, loss=e.loss)
             for e in events if isinstance(e, ev.Step) and _worker(e)]
    reported = {s.slot for s in steps}
    steps += [_Step(slot=s.slot, rank=s.rank, attempt=s.attempt, gen=0, step=s.step,
                    start=s.start, end=s.end, loss=s.loss, numbered=s.numbered)
              for s in seen.steps if s.slot not in reported]
    last: dict[tuple[int, ...], _Step] = {}
    for s in sorted(steps, key=lambda s: s.end):
        key = (s.slot, s.step) if s.numbered else (s.slot, s.step, -1 - s.attempt)
        if key in last:
            last[key].redone = True  # computed again later: that one was wasted
        last[key] = s
    return steps


def _slot_or_rank(e: EventBody) -> int | None:
    return e.slot if e.slot is not None else e.rank


def _fault_start(f: ev.Fault, events: list[EventBody]) -> tuple[float, bool]:
    """When a fault happened (its injection if injected, a hang's last heartbeat, else its
    detection), and whether it was injected."""
    slot = _slot_or_rank(f)
    injected = [e.t for e in events if isinstance(e, ev.FaultInjected) and e.t <= f.t
                and e.attempt == _attempt(f) and _slot_or_rank(e) == slot]
    return (injected[-1], True) if injected else (f.hang_started or f.t, False)


def fault_key(f: ev.Fault) -> tuple:
    """What identifies one fault across its `fault` events: attempt, kind, and the process."""
    return _attempt(f), f.kind, f.pid or (f.rank, f.step)


def distinct_faults(events: Iterable[dict[str, Any] | EventBody]) -> list[SeenFault]:
    """The run's faults, each once: a death first taken in place and then charged to a
    full restart is logged twice (same process); the later record's fields win."""
    events = ev.decode_all(events)
    seen: dict[tuple, SeenFault] = {}
    for f in (e for e in events if isinstance(e, ev.Fault)):
        key = fault_key(f)
        first = seen.get(key)
        began, injected = (first.began, first.injected) if first else _fault_start(f, events)
        seen[key] = SeenFault(f, began, first.t if first else f.t, injected)
    return list(seen.values())


def _windows(events, faults, world: int, t_end: float) -> tuple[
        list[tuple[float, int | None, bool]], list[tuple[float, float, frozenset[int]]]]:
    """Recovery window openers (time, slot or None for every slot, whether a fault opened
    it) and the spans the job ran shrunk, each with the slots missing from it."""
    opens: list[tuple[float, int | None, bool]] = [(f.began, None, True) for f in faults]
    opens += [(e.t, e.slot, False) for e in events
              if isinstance(e, ev.GenLeave) and _worker(e)]
    opens += [(e.t, None, False) for e in events if isinstance(e, ev.Restart)]
    members: dict[Any, set[int]] = defaultdict(set)  # generation -> the slots that joined it
    for e in events:
        if isinstance(e, ev.GenSwitch) and _worker(e):
            members[(_attempt(e), e.gen)].add(e.slot)
    shrunk: list[tuple[float, float, frozenset[int]]] = []
    open_span: tuple[float, frozenset[int]] | None = None
    # Once a rank has finished training, the job is ending: nothing more is lost to the size.
    done = min((e.t for e in events if isinstance(e, ev.TrainingDone)), default=t_end)
    for e in events:
        if e.t > done:
            break
        if not isinstance(e, ev.GenUp | ev.Restart):
            continue
        if open_span is not None:
            shrunk.append((open_span[0], e.t, open_span[1]))
            open_span = None
        if isinstance(e, ev.GenUp) and (e.world_size if e.world_size is not None
                                        else world) < world:
            here = members.get((_attempt(e), e.gen), set())
            open_span = (e.t, frozenset(set(range(world)) - here))
    if open_span is not None:
        shrunk.append((open_span[0], done, open_span[1]))
    return opens, shrunk


def straggler_threshold(median: float) -> float:
    """The duration past which a step is a straggler's (`STRAGGLER_FACTOR`, `..._FLOOR_S`)."""
    return max(STRAGGLER_FACTOR * median, median + STRAGGLER_FLOOR_S)


def _labels_for_slot(slot: int, mine: list[EventBody], own: list[_Step],
                     launches: list[EventBody], median: float | None, opens, shrunk,
                     t0: float, checkpoints: bool) -> list[Label]:
    """`mine`: the slot's worker events; `own`: its step computations, by end;
    `launches`: the agents' `workers_started` and `replacement_started` events."""
    launched = [(e.t, e.node) for e in launches if isinstance(e, ev.WorkersStarted)
                or e.slot == slot]
    starts = sorted(s.start for s in own)
    ends = [s.end for s in own]
    by_step: dict[int, list[_Step]] = defaultdict(list)
    for s in own:
        by_step[s.step].append(s)
    labels: list[Label] = []
    slow = straggler_threshold(median) if median else None
    for prev, s in zip([None, *own], own, strict=False):
        labels.append(Label(s.start, s.end, "redone" if s.redone else "step"))
        follows = prev is not None and s.step == prev.step + 1 \
            and (s.attempt, s.gen) == (prev.attempt, prev.gen)
        if follows:  # the loop's own work between two steps: as the step before it
            labels.append(Label(prev.end, s.start, "redone" if prev.redone else "between_steps"))
        if follows and not s.redone and slow and s.end - s.start > slow:
            labels.append(Label(s.start + median, s.end, "straggler"))

    def next_start(t: float) -> float | None:
        at = bisect.bisect_left(starts, t)
        return starts[at] if at < len(starts) else None

    def last_end(t: float) -> float | None:
        at = bisect.bisect_right(ends, t)
        return ends[at - 1] if at else None

    first_process = True
    for e in mine:
        t = e.t
        if isinstance(e, ev.WorkerStart):
            if e.startup is not None:
                pg = e.process_group or 0.0
                # A warm interpreter's process was started long before the agent handed it this
                # job: its startup counts from that hand-over, not from its process start.
                began = max([t - e.startup, *(a for a, node in launched
                                              if a <= t and node == e.node)])
                labels.append(Label(began, t - pg, "startup"))
                labels.append(Label(t - pg, t, "rendezvous"))
                if first_process:
                    labels.append(Label(t0, began, "spawn"))
            first_process = False
            end = next_start(t)
            labels.append(Label(t, end if end is not None else t, "setup"))
        elif isinstance(e, ev.CheckpointLoaded) and e.duration is not None:
            labels.append(Label(t - e.duration, t, "restore"))
        elif isinstance(e, ev.Phase) and e.name in DATA_PHASES:
            labels.append(Label(t - e.duration, t, "data"))
        elif isinstance(e, ev.CheckpointSaved | ev.CheckpointFailed) and e.stall:
            before = [s for s in by_step.get(e.step - 1, ()) if s.end <= t]
            if before:
                labels.append(Label(before[-1].end, before[-1].end + e.stall, "stall"))
        elif isinstance(e, ev.TrainingDone) and (last := last_end(t)) is not None:
            labels.append(Label(last, t, "flush" if checkpoints else "between_steps"))
    mine_opens = sorted(o for o in opens if o[1] in (None, slot))
    for i, (t, _, fault) in enumerate(mine_opens):
        end = next_start(t)
        if end is None:
            continue  # never resumed on this slot: the time stays idle (or capacity lost)
        labels.append(Label(t, end, "recovery"))
        last = last_end(t)
        # The step a fault cut short: this slot's, if it was stepping when the fault came
        # (no earlier fault or leave since its last step).
        if last is not None and fault and not any(last < o[0] < t for o in mine_opens[:i]):
            labels.append(Label(last, t, "cut_short"))
    labels += [Label(a, b, "shrunk") for a, b, missing in shrunk if slot in missing]
    return labels


def _fault_rows(faults: list[SeenFault], segments: list[Segment],
                steps: list[_Step]) -> list[dict[str, Any]]:
    """Each fault with its cost: the rank-seconds of every slot, from the fault to that
    slot's next step, that were not productive, plus the computations it made redone."""
    rows = []
    ordered = sorted(faults, key=lambda f: f.began)
    # A redone computation is the cost of the fault that led to its being computed again:
    # the last fault before the computation that the run kept.
    kept = {(s.slot, s.step): s for s in steps if not s.redone}
    began_at = [f.began for f in ordered]
    redone_by: dict[int, list[_Step]] = defaultdict(list)
    for s in steps:
        again = kept.get((s.slot, s.step))
        if s.redone and again is not None:
            at = bisect.bisect_right(began_at, again.start) - 1
            if at >= 0:
                redone_by[id(ordered[at])].append(s)
    productive: dict[int, list[float]] = defaultdict(list)
    for seg in segments:
        if seg.category == Category.PRODUCTIVE_STEP:
            productive[seg.slot].append(seg.start)
    for i, f in enumerate(ordered):
        began = f.began
        until = ordered[i + 1].began if i + 1 < len(ordered) else float("inf")
        cost: dict[str, float] = defaultdict(float)
        for seg in segments:
            if seg.category in (Category.PRODUCTIVE_STEP, Category.WASTED_PROGRESS) \
                    or seg.end <= began:
                continue  # redone computations are charged below, to the fault that caused them
            # the fault's window on this slot: up to the slot's next productive segment
            starts = productive[seg.slot]
            at = bisect.bisect_left(starts, began)
            resumed = starts[at] if at < len(starts) else float("inf")
            lo, hi = max(seg.start, began), min(seg.end, resumed, until)
            if hi > lo:
                cost[seg.category.value] += hi - lo
        for s in redone_by.get(id(f), ()):
            cost[Category.WASTED_PROGRESS.value] += s.end - s.start
        e = f.event
        rows.append({
            "kind": e.kind, "rank": e.rank, "node": e.node,
            "attempt": _attempt(e), "step": e.step, "t": f.t,
            "detail": e.detail, "in_place": bool(e.in_place), "injected": f.injected,
            "detection": round(f.t - began, 3),
            "cost_s": {k: round(v, 6) for k, v in sorted(cost.items()) if v > 0},
        })
    return rows


def account(events: Iterable[dict[str, Any] | EventBody], slots: list[int] | None = None,
            until: float | None = None) -> dict[str, Any]:
    """The run's goodput report (schema: docs/goodput.md), from its merged, time-ordered
    events (records, or events already decoded: `schema.decode`). Pure: no I/O.

    `slots`: account only these ranks (a live leader that reads only its own node's log);
    default every rank of the job's world. `until`: the end of the accounted time (a run
    still going: now); default the last agent's exit, else the last event."""
    events = ev.decode_all(events)
    if not events:
        raise ValueError("no events to account for")
    starts = [e.t for e in events if isinstance(e, ev.AgentStart)]
    exits = [e.t for e in events if isinstance(e, ev.AgentExit)]
    t0 = min(starts) if starts else events[0].t
    t_end = until if until is not None else (max(exits) if exits else events[-1].t)
    t_end = max(t_end, t0)
    world = max((e.world_size or 0 for e in events
                 if isinstance(e, ev.WorkerStart) and _worker(e)), default=0)
    seen = watched(events, t0)
    steps = _steps(events, seen)
    steps_known = bool(steps)
    if not world:  # a plain script: no worker reports; the agents know the ranks they start
        world = sum(len(e.pids or {}) for e in events
                    if isinstance(e, ev.WorkersStarted) and _attempt(e) == 0)
    faults = distinct_faults(events)
    # Imported here: `statistics` brings `fractions` and `decimal` (~10 ms), and every agent
    # imports this module (the leader's live telemetry) while only a leader accounts.
    import statistics

    median = statistics.median(s.end - s.start for s in steps) if steps else None
    opens, shrunk = _windows(events, faults, world, t_end)
    checkpoints = any(isinstance(e, ev.CheckpointSaved) for e in events)
    accounted = list(range(world)) if slots is None else sorted(slots)
    segments: list[Segment] = []
    if steps_known:
        by_slot: dict[int, list[EventBody]] = defaultdict(list)
        for e in events:
            if _worker(e):
                by_slot[e.slot].append(e)
        own: dict[int, list[_Step]] = defaultdict(list)
        for s in sorted(steps, key=lambda s: s.end):
            own[s.slot].append(s)
        launches = [e for e in events
                    if isinstance(e, ev.WorkersStarted | ev.ReplacementStarted)]
        for slot in accounted:
            labels = _labels_for_slot(slot, by_slot[slot], own[slot], launches, median, opens,
                                      shrunk, t0, checkpoints) + seen.labels.get(slot, [])
            segments += sweep(labels, t0, t_end, slot)
    else:
        segments = _plain_segments(events, accounted, faults, t0, t_end)
    report = _report(events, t0, t_end, accounted, steps, steps_known, faults, segments, median)
    if seen.watched and not any(isinstance(e, ev.Step) for e in events):
        # an unchanged script's workers were watched (not a `Run`'s): what was measured
        report["watched"] = watched_summary(seen, steps_known)
    return report


def _plain_segments(events: list[EventBody], slots: list[int], faults: list[SeenFault],
                    t0: float, t_end: float) -> list[Segment]:
    """A script that reports no steps to unbroken (no `step` event in the whole run): what is
    known is when the agents started its processes, when they ended, and its faults. Per slot:

    - `spawn`: from the job's start to the first `workers_started`;
    - `untracked`: the slot's process of each attempt, from its node's `workers_started` whose
      `pids` name the slot (all slots if it has no `pids`) to the first of: the attempt's
      first fault's start (in a script that reports nothing, any fault ends the attempt),
      the node's `workers_done` or `workers_stopped` of that attempt, the node's next
      `workers_started`, the job's end;
    - `recovery`: from each fault's start to the next `workers_started` after it.

    The rule is per run, not per attempt: in a run that reports steps, an attempt that died
    before its first step keeps the step rules (its time is startup, set-up, recovery),
    since the script does report progress and simply made none."""
    started = sorted((e for e in events if isinstance(e, ev.WorkersStarted)),
                     key=lambda e: e.t)
    restarts = [e.t for e in started]
    ends = [(e.t, e.node, _attempt(e)) for e in events
            if isinstance(e, ev.WorkersDone | ev.WorkersStopped)]
    ran: list[tuple[float, float, set[str] | None]] = []  # (start, end, its ranks; None: all)
    for i, e in enumerate(started):
        end = min([t_end, *(n.t for n in started[i + 1:] if n.node == e.node),
                   *(t for t, node, a in ends if (node, a) == (e.node, _attempt(e))),
                   *(f.began for f in faults if _attempt(f.event) == _attempt(e))])
        ran.append((e.t, end, None if e.pids is None else {str(r) for r in e.pids}))
    segments = []
    for slot in slots:
        labels = [Label(t0, restarts[0], "spawn")] if restarts else []
        labels += [Label(a, b, "untracked") for a, b, ranks in ran
                   if ranks is None or str(slot) in ranks]
        for f in faults:
            nxt = next((t for t in restarts if t > f.t), None)
            if nxt is not None:
                labels.append(Label(f.began, nxt, "recovery"))
        segments += sweep(labels, t0, t_end, slot)
    return segments


def _totals(segments: Iterable[Segment], lo: float = float("-inf"),
            hi: float = float("inf")) -> dict[str, float]:
    out = {c.value: 0.0 for c in Category}
    for s in segments:
        a, b = max(s.start, lo), min(s.end, hi)
        if b > a:
            out[s.category.value] += b - a
    return out


def _report(events, t0, t_end, slots, steps, steps_known, faults, segments, median):
    wall = t_end - t0
    world = len(slots)
    n = max(world, 1)
    total = _totals(segments)
    seconds = {k: round(v / n, 6) for k, v in total.items()}
    goodput = (total[Category.PRODUCTIVE_STEP] / (wall * n)) if steps_known and wall > 0 else None
    attempt_starts = sorted({(_attempt(e), e.t) for e in events
                             if isinstance(e, ev.WorkersStarted)})
    firsts: dict[int, float] = {}
    for a, t in attempt_starts:
        firsts.setdefault(a, t)
    firsts[0] = t0
    order = sorted(firsts.items())
    attempts = []
    for i, (a, start) in enumerate(order):
        end = order[i + 1][1] if i + 1 < len(order) else t_end
        part = _totals(segments, start, end)
        attempts.append({"attempt": a, "start": start, "end": end,
                         "seconds": {k: round(v / n, 6) for k, v in part.items()}})
    dropped = sum(e.dropped or 0 for e in events if isinstance(e, ev.EventsDropped))
    return {
        "t0": t0, "wall_s": round(wall, 6), "world_size": world,
        "goodput": round(goodput, 6) if goodput is not None else None,
        "steps_known": steps_known, "events_dropped": dropped,
        "median_step_s": round(median, 6) if median else None,
        "categories": [c.value for c in Category],
        "seconds": seconds,
        "badput_s": {c.value: seconds[c.value] for c in BADPUT},
        "ranks": [{"slot": slot, "seconds": {k: round(v, 6) for k, v in
                                             _totals(s for s in segments if s.slot == slot).items()}}
                  for slot in slots],
        "attempts": attempts,
        "faults": _fault_rows(faults, segments, steps),
        "recoveries": [{"gen": e.gen, "t": e.t, "duration": e.duration,
                        "world_size": e.world_size, "faults": e.faults or []}
                       for e in events if isinstance(e, ev.GenUp)],
        "checkpoints": [{"step": e.step, "t": e.t, "slot": e.slot, "stall": e.stall,
                         "durable": getattr(e, "durable", None),
                         "bytes": getattr(e, "bytes", None),
                         "ok": isinstance(e, ev.CheckpointSaved)}
                        for e in events
                        if isinstance(e, ev.CheckpointSaved | ev.CheckpointFailed) and _worker(e)],
        "steps": [{"slot": s.slot, "rank": s.rank, "attempt": s.attempt, "gen": s.gen,
                   "step": s.step, "start": s.start, "end": s.end,
                   "duration": round(s.end - s.start, 6), "loss": s.loss, "redone": s.redone}
                  for s in sorted(steps, key=lambda s: (s.end, s.slot))],
        "spares": [{"t": e.t, "node": e.node,
                    "event": "ready" if isinstance(e, ev.SpareReady) else "promoted"}
                   for e in events if (isinstance(e, ev.SpareReady) and e.source == "worker")
                   or (isinstance(e, ev.SparePromoted) and e.source == "agent")],
        "timeline": [{"slot": s.slot, "start": s.start, "end": s.end,
                      "category": s.category.value} for s in segments],
    }
