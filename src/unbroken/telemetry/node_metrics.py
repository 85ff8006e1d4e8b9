"""What one node's agent exports: its own events and its workers' folded into monotonic
counters (names: `metric_names.Metric.NODE_*`). Pure: no I/O, no clock; `node_export`
serves them.

Two inputs, so that nothing is counted twice whoever reads a shared log: the agent's own
events as it emits them (`fold_own`), and its node's worker events as they appear in the
log (`fold_worker`, only those whose `node` is this one).

`RankSeconds` turns the goodput accounting (`goodput.account`, which may move a second from
one category to another as later events arrive: a rollback makes steps wasted) into
counters that never go down: each category's counter is the largest the accounting has
given it. A second the accounting moved after it was counted stays counted where it was
first: a 5-minute rate over such a move is high by at most what moved. `unbroken report`
stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unbroken.control.messages import FaultKind
from unbroken.telemetry import schema as ev
from unbroken.telemetry.categories import Category
from unbroken.telemetry.goodput import fault_key
from unbroken.telemetry.metric_names import Metric

SETTLE_S = 60.0
"""The most the rank-seconds lag the present. They are counted up to the oldest of the
node's held slots' last events (a step's time is known only when it ends), but never
further back than this (a long recovery, a hung rank: counted as the accounting has it)."""

IN_PLACE, RESTART = "in_place", "restart"
RECOVERY_KINDS = (IN_PLACE, RESTART)
FAULT_KINDS = tuple(k.value for k in FaultKind)

Observation = tuple[Metric, Any, float]
"""(metric, its label value or None, the amount: an increment, or a histogram's sample)."""


@dataclass
class NodeCounters:
    """One node's counters, folded from events. `fold_*` return the observations made."""

    node: int
    steps: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    stall: float = 0.0
    _faults_seen: set = field(default_factory=set)
    _gens: set = field(default_factory=set)
    _attempts: set = field(default_factory=set)
    slots: dict[int, tuple[float, float | None]] = field(default_factory=dict)
    """Each slot this node's workers held: (since, until or None while held here)."""
    last_seen: dict[int, float] = field(default_factory=dict)
    """Each slot's last worker event here."""

    def fold_own(self, e: ev.EventBody) -> list[Observation]:
        """An event this node's agent emitted."""
        if isinstance(e, ev.Fault):
            key = fault_key(e)  # a death taken in place, then charged to a restart: once
            if key in self._faults_seen:
                return []
            self._faults_seen.add(key)
            kind = str(e.kind)
            self.faults[kind] = self.faults.get(kind, 0) + 1
            slot = e.slot if e.slot is not None else e.rank
            if isinstance(slot, int) and slot in self.slots and e.t is not None:
                self.slots[slot] = (self.slots[slot][0], e.t)
            return [(Metric.NODE_FAULTS, kind, 1)]
        if isinstance(e, ev.WorkersStarted | ev.ReplacementStarted) and e.t is not None:
            for slot in _started_slots(e):
                self.slots[slot] = (self.slots[slot][0] if slot in self.slots
                                    and self.slots[slot][1] is None else e.t, None)
            attempt = e.attempt or 0
            if isinstance(e, ev.WorkersStarted) and attempt > 0 \
                    and attempt not in self._attempts:
                self._attempts.add(attempt)
                return [(Metric.NODE_RECOVERIES, RESTART, 1)]
        return []

    def fold_worker(self, e: ev.EventBody) -> list[Observation]:
        """An event one of this node's workers emitted (`e.node == self.node`)."""
        slot = e.slot
        if isinstance(slot, int) and slot >= 0 and e.t is not None \
                and (slot not in self.slots or self.slots[slot][1] is not None
                     and e.t > self.slots[slot][1]):
            self.slots[slot] = (e.t, None)  # a spare promoted here, or a slot back here
        if isinstance(slot, int) and slot >= 0 and e.t is not None:
            self.last_seen[slot] = max(e.t, self.last_seen.get(slot, e.t))
        if isinstance(e, ev.Step):
            self.steps += 1
            return [(Metric.NODE_STEPS, None, 1)]
        if isinstance(e, ev.CheckpointSaved | ev.CheckpointFailed) and e.stall is not None:
            self.stall += e.stall
            return [(Metric.NODE_CHECKPOINT_STALL, None, e.stall)]
        if isinstance(e, ev.GenSwitch):
            obs: list[Observation] = [(Metric.NODE_SWITCH_TIME, None, e.duration)]
            if e.gen not in self._gens:
                self._gens.add(e.gen)
                obs.append((Metric.NODE_RECOVERIES, IN_PLACE, 1))
            return obs
        return []


def _started_slots(e: ev.WorkersStarted | ev.ReplacementStarted) -> list[int]:
    if isinstance(e, ev.WorkersStarted):
        return [int(r) for r in (e.pids or {})]
    slot = e.slot if e.slot is not None else e.rank
    return [slot] if isinstance(slot, int) and slot >= 0 else []


def tenancy_seconds(timeline: list[dict[str, Any]],
                    slots: dict[int, tuple[float, float | None]],
                    until: float) -> dict[str, float]:
    """Rank-seconds by category of the accounting's `timeline` (its segments), each slot's
    only while this node held it. Pure."""
    out = {c.value: 0.0 for c in Category}
    for seg in timeline:
        held = slots.get(seg["slot"])
        if held is None:
            continue
        lo = max(seg["start"], held[0])
        hi = min(seg["end"], held[1] if held[1] is not None else until)
        if hi > lo:
            out[seg["category"]] += hi - lo
    return out


@dataclass
class RankSeconds:
    """Counters that never go down over an accounting that may (see the module)."""

    counted: dict[str, float] = field(default_factory=lambda: {c.value: 0.0 for c in Category})

    def advance(self, accounted: dict[str, float]) -> list[Observation]:
        """The increments that bring each category's counter up to `accounted`, if higher."""
        obs: list[Observation] = []
        for category, seconds in accounted.items():
            gain = seconds - self.counted.get(category, 0.0)
            if gain > 1e-9:
                self.counted[category] = seconds
                obs.append((Metric.NODE_RANK_SECONDS, category, gain))
        return obs


def settled_until(now: float, counters: NodeCounters) -> float:
    """The end of the time counted in rank-seconds now (`SETTLE_S`). Pure."""
    held = [counters.last_seen.get(slot, since) for slot, (since, until) in
            counters.slots.items() if until is None]
    return min(now, max(min(held, default=now), now - SETTLE_S))
