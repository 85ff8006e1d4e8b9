"""The accounting of an unchanged script, from what the hooks saw (`runtime/watch/`): its
steps numbered across attempts, its checkpoints charged, and what could not be known (pure).

- **Resume step.** Each attempt's steps count from 1 in their process. An attempt after the
  first resumed from the save whose file it loaded: a `script_load` is matched to the
  earlier attempts' `script_save`s by file identity (`[st_dev, st_ino, st_size,
  st_mtime_ns]`, which `os.replace` keeps; for DCP, the directory's `.metadata`), the newest
  such save winning. The attempt's step i is then step `save + i` of the job, and the
  earlier steps past the save are computed again: `wasted_progress`, by the sweep's
  `redone` rule. An attempt that loads nothing started again from step 0. One whose loads
  match no save (a stream, a file from outside the run) has its resume step unknown: its
  steps are never matched to an earlier attempt's.
- **Who pays for a save.** The saving rank, its time inside the call (`stall`), and its
  waits on an asynchronous save's future (`script_save_wait`, whose files are the save's
  once written: a later load is matched by them). A rank that
  waited for it at its next collective: by step index, not by clock (nodes share none),
  the excess of its step after the save over its own median step, at most the save's time.
- **Loads** are `restore`; the process's start to its `script_watched` line is `startup`,
  and from there to its first step, `setup`; the job's start to its first process, `spawn`;
  its last step to the end of its node's workers (`workers_done`), as the steps before.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from unbroken.telemetry import schema as ev
from unbroken.telemetry.intervals import Label
from unbroken.telemetry.schema import EventBody


@dataclass(frozen=True)
class WatchedStep:
    slot: int
    rank: int
    attempt: int
    step: int
    """The job's step (the resume step plus the attempt's own count), or the attempt's own
    count where the resume step is unknown (`numbered` False)."""
    start: float
    end: float
    loss: float | None
    numbered: bool


@dataclass
class Watched:
    """What the hooks' events say, for `goodput.account`."""

    steps: list[WatchedStep] = field(default_factory=list)
    labels: dict[int, list[Label]] = field(default_factory=lambda: defaultdict(list))
    resumed: dict[int, int | None] = field(default_factory=dict)
    """Each attempt after the first: the step it resumed from (None: unknown)."""
    saves: int = 0
    loads: int = 0
    save_s: list[float] = field(default_factory=list)
    """Each save's time inside the call: the longest of its ranks' (a DCP save is every
    rank's), one entry per (attempt, step)."""
    save_every_s: list[float] = field(default_factory=list)
    """The time between one save's end and the next one's start, within an attempt."""
    watched: bool = False
    """Some worker was watched (`script_watched`)."""


def _attempt(e: EventBody) -> int:
    return e.attempt if e.attempt is not None else 0


def _slot(e: EventBody) -> int | None:
    return e.slot if e.slot is not None else e.rank


def _files(e: ev.ScriptSave | ev.ScriptSaveWait | ev.ScriptLoad) -> set[tuple[int, ...]]:
    return {tuple(f) for f in e.files or () if isinstance(f, list) and len(f) == 4}


def resume_steps(events: list[EventBody]) -> dict[int, int | None]:
    """Each attempt after the first: the job's step its workers resumed from (0: they
    loaded nothing), or None where no load matched a save of an earlier attempt."""
    saves = [e for e in events if isinstance(e, ev.ScriptSave | ev.ScriptSaveWait)]
    loads = [e for e in events if isinstance(e, ev.ScriptLoad)]
    attempts = sorted({_attempt(e) for e in events if isinstance(e, ev.ScriptWatched)} - {0})
    offset: dict[int, int | None] = {0: 0}
    for a in attempts:
        mine = [e for e in loads if _attempt(e) == a]
        if not mine:
            offset[a] = 0
            continue
        found: int | None = None
        for load in mine:
            wanted = _files(load)
            earlier = [s for s in saves if _attempt(s) < a and _files(s) & wanted
                       and s.t <= load.t]
            if earlier:
                best = max(earlier, key=lambda s: s.t)
                base = offset.get(_attempt(best))
                found = None if base is None else base + best.step
                break
        offset[a] = found
    return {a: v for a, v in offset.items() if a != 0}


def watched(events: list[EventBody], t0: float) -> Watched:
    """The steps and labels of every watched worker of the run, which began at `t0`."""
    out = Watched()
    out.watched = any(isinstance(e, ev.ScriptWatched) for e in events)
    if not out.watched:
        return out
    out.resumed = resume_steps(events)
    offsets = {0: 0, **out.resumed}
    for e in events:
        if isinstance(e, ev.ScriptSteps) and _slot(e) is not None:
            a = _attempt(e)
            base = offsets.get(a)
            for row in e.steps:
                local, began, ended, _updated, loss = (list(row) + [None] * 5)[:5]
                out.steps.append(WatchedStep(
                    slot=_slot(e), rank=e.rank if e.rank is not None else _slot(e),
                    attempt=a, step=(base or 0) + int(local), start=float(began),
                    end=float(ended), loss=loss, numbered=base is not None))
    medians: dict[int, float] = {}
    by_slot: dict[int, list[WatchedStep]] = defaultdict(list)
    for s in out.steps:
        by_slot[s.slot].append(s)
    for slot, steps in by_slot.items():
        medians[slot] = statistics.median(s.end - s.start for s in steps)
    index = {(s.slot, s.attempt, s.step - (offsets.get(s.attempt) or 0)): s
             for s in out.steps}
    firsts: dict[tuple[int, int], float] = {}
    for s in out.steps:
        key = (s.slot, s.attempt)
        firsts[key] = min(firsts.get(key, s.start), s.start)
    done = max((e.t for e in events if isinstance(e, ev.WorkersDone)), default=None)
    for slot, steps in by_slot.items():
        last = max(s.end for s in steps)
        if done is not None and done > last:
            out.labels[slot].append(Label(last, done, "between_steps"))
    spawned: set[int] = set()
    savers: dict[tuple[int, int], set[int]] = defaultdict(set)  # (attempt, step) -> slots
    for e in events:
        if isinstance(e, ev.ScriptSave) and _slot(e) is not None:
            savers[(_attempt(e), e.step)].add(_slot(e))
    for e in events:
        slot = _slot(e)
        if slot is None or e.source != "worker":
            continue
        if isinstance(e, ev.ScriptWatched) and e.startup is not None:
            first = firsts.get((slot, _attempt(e)), e.t)
            out.labels[slot] += [Label(e.t - e.startup, e.t, "startup"),
                                 Label(e.t, first, "setup")]
            if slot not in spawned:
                spawned.add(slot)
                out.labels[slot].append(Label(t0, e.t - e.startup, "spawn"))
        elif isinstance(e, ev.ScriptSaveWait):  # an asynchronous save waited for
            out.labels[slot].append(Label(e.t - e.duration, e.t, "stall"))
        elif isinstance(e, ev.ScriptLoad):
            out.loads += 1
            out.labels[slot].append(Label(e.t - e.duration, e.t, "restore"))
        elif isinstance(e, ev.ScriptSave):
            out.saves += 1
            out.labels[slot].append(Label(e.t - e.duration, e.t, "stall"))
            _charge_waiters(out, e, savers[(_attempt(e), e.step)], index, medians)
    _cadence(out, [e for e in events if isinstance(e, ev.ScriptSave)])
    return out


def _cadence(out: Watched, saves: list[ev.ScriptSave]) -> None:
    """What one save of the script costs and how often it comes: today's checkpoints, for
    `unbroken simulate --from-run`."""
    by: dict[tuple[int, int], list[ev.ScriptSave]] = defaultdict(list)
    for e in saves:
        by[(_attempt(e), e.step)].append(e)
    spans = sorted((a, min(e.t - e.duration for e in es), max(e.t for e in es),
                    max(e.duration for e in es)) for (a, _), es in by.items())
    out.save_s = [round(d, 6) for *_, d in spans]
    out.save_every_s = [round(b[1] - a[2], 6) for a, b in zip(spans, spans[1:], strict=False)
                        if a[0] == b[0] and b[1] > a[2]]


def _charge_waiters(out: Watched, save: ev.ScriptSave, savers: set[int],
                    index: dict[tuple[int, int, int], WatchedStep],
                    medians: dict[int, float]) -> None:
    """Every rank that did not save at that step (a DCP save is every rank's): its step
    after the save (by index), its excess over its median step, up to the save's time, was
    spent waiting for it."""
    a = _attempt(save)
    for slot, median in medians.items():
        if slot in savers:
            continue
        after = index.get((slot, a, save.step + 1))
        if after is None:
            continue
        excess = min(after.end - after.start - median, save.duration)
        if excess > 0:
            out.labels[slot].append(Label(after.start + median, after.start + median + excess,
                                          "stall"))


def summary(w: Watched, steps_known: bool) -> dict[str, Any]:
    """What the report says was measured, and what could not be."""
    notes = []
    if w.watched and not steps_known:
        notes.append("no optimizer step seen: steps unknown")
    unknown = sorted(a for a, v in w.resumed.items() if v is None)
    if unknown:
        notes.append(f"resume step unknown in attempt(s) {', '.join(map(str, unknown))}: "
                     f"no load matched a save of this run (a stream, or a file from outside)")
    return {"watched": w.watched, "saves": w.saves, "loads": w.loads, "save_s": w.save_s,
            "save_every_s": w.save_every_s,
            "resumed_from": {str(a): v for a, v in sorted(w.resumed.items())}, "notes": notes}
