"""Stragglers: a rank persistently slower than its peers, as a pure function of what they timed.

`decide(state, point, config)` takes the detector's state (`StragglerState`, a value) and one
`Point` (every rank's own step times over the last `batch` steps, gathered so that every rank
holds the same point), and returns the new state and the `Action`s to take. It does no I/O,
reads no clock and uses no torch: every rank runs it on the same point and reaches the same
decision, and every property below is a table test (tests/unit/test_stragglers.py).

The method. A rank's *own* time for a step runs from the step's start to its first gradient
collective: it leaves out the wait for its peers, which in lockstep training every rank would
otherwise share. Each point, for each rank r:

- m_r = the median of its `batch` own times (one slow step out of 5 does not move it);
- its ratio to its peers, m_r / median_{j != r} m_j, with the median over the *other* ranks
  (leave-one-out: with 2 ranks, the slow one's ratio is 1.5 and the other's 0.67);
- y_r = ln(ratio), clipped to [-c, c], and a one-sided CUSUM per slot,
  S_r <- min(cap, max(0, S_r + y_r - k)), with delta = ln(target_ratio), k = delta / 2,
  c = 1.25 delta and cap = 1.5 x threshold (so a long slowdown clears soon after it ends).

A slot is flagged (`Flag`) when S_r >= threshold and its point's ratio is >= min_ratio, and
cleared (`Clear`) when S_r is back to 0. The flag's `since_step` is the step of the last point
at which S_r was 0: the slowdown began after it (the onset estimate). Under the DRAIN remedy a
flag comes with a `Drain` of its slot, at most one per point and none within `cooldown` steps
of the last; a flagged slot the cooldown held back is drained at the first point past it at
which it is still flagged and still >= min_ratio (a `Drain` without a new `Flag`).

What holds with the defaults (batch 5, target 1.5, threshold 0.8, min_ratio 1.25):

- A sustained 1.5x slowdown adds k = 0.20 a point: flagged 4 points after the first whole
  slow batch (4 k = 0.81), or 5 when noise dips: 20 to 25 steps, with 4 ranks or with 2;
  `since_step` is the onset to within a batch. 2x and more: 3 points; 1.3x: 12 to 16.
- A 1.2x rank is never flagged: its drift ln 1.2 - k = -0.02 is negative, and 1.2 < min_ratio.
  A rank slow from birth, or mildly heterogeneous hardware, is not a fail-slow.
- One point adds at most c - k = 0.30, so no single bad batch flags: it takes at least 3
  points in a row far from the peers. Sparse jitter (each rank-step slowed by up to 4x with
  probability 0.05) moves a median of 5 only when 3 of the 5 are hit (p ~ 0.001 a point):
  zero flags over 1000 seeded series of 2000 steps x 4 ranks (for each of 5 seeds).
- Dense jitter (p = 0.2) moves a median of 5 too often (p ~ 0.06 a point: 83 flags over
  1000 series): it needs `batch = 9` (a median of 9 moves only when 5 of 9 are hit, p ~
  0.02): 2 flags over 5000 series, each from 3 hit batches in a row. False flags are a rate
  per rank-point (here ~5e-7), so a large world sees them proportionally more often.
- A flag clears 6 or 7 points (30 to 35 steps) after even a long slowdown ends (the cap).
- With 1 rank there are no peers: no Flag, Clear or Drain, only the own-history part below.

Own history (report only). A job that slows as a whole (a shared file system, a throttled
switch, a thermal event in every node) keeps every ratio at 1. Per slot, a baseline is the
median of the slot's first 20 m values after warm-up; a second CUSUM runs on
ln(m_r / baseline_r) with the same k, c, cap and threshold. When every slot's alarms at the
same point, and the median of m_r / baseline_r is >= min_ratio, a `JobSlow` is emitted, once,
until every slot's own-history CUSUM is back to 0: 20 to 25 steps after a 1.5x onset, with
no Flag (the ratios stay 1). A slot with no baseline yet holds it back. One slot's alarm
alone is a straggler's business, seen by its peers.

Resets. `reset` (a start, a generation switch, a rollback, a drain) restarts the warm-up and
forgets every CUSUM, flag, baseline and the job-wide alarm: the ranks, their batch shapes or
their nodes may have changed, and a step re-run after a rollback is not comparable. It keeps
the step of the last drain, so the cooldown spans the switch a drain causes (a rollback to
before it makes the cooldown longer: it ends at that step + `cooldown` all the same). The first
`warmup` points after a reset update nothing and return no actions. A flag a reset or a
membership change ends gets no `Clear`: the caller's own event (the switch, the rollback)
says why. A slot that leaves the point is forgotten; a new slot, or a slot now on another
node (replaced in place), starts at 0 with no baseline.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import ClassVar

from unbroken.runtime.config import StragglerConfig, StragglerRemedy

BASELINE_POINTS = 20
"""Points after warm-up whose median m is a slot's own-history baseline."""
CAP = 1.5
"""Every CUSUM stays at or below CAP x threshold: it is back to 0 within a few points of the
end of a long slowdown."""
FLOOR_S = 1e-6
"""Own times are taken as at least this (seconds), so that every ratio has a logarithm."""


class ActionKind(StrEnum):
    FLAG = "flag"  # a slot became a straggler
    CLEAR = "clear"  # a flagged slot is back among its peers
    DRAIN = "drain"  # move the slot onto a ready spare (remedy DRAIN)
    JOB_SLOW = "job_slow"  # every slot slowed together: not a straggler, the whole job


@dataclass(frozen=True)
class Point:
    """Every rank's own step times over the last `batch` steps, the same on every rank.

    Row i is rank i's: `slots[i]`, the node it runs on `nodes[i]`, and `own[i]`, its own
    times in seconds (from a step's start to its first gradient collective). `step` is the
    training step at which the point was gathered; its rows cover the steps just before it.
    Contract: the three tuples have one entry per rank (at least one), slots are distinct,
    and every row holds at least one time.
    """

    step: int
    slots: tuple[int, ...]
    nodes: tuple[int, ...]
    own: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class Flag:
    """`slot` (on `node`) is a straggler at `step`: its median own time `own_s` is `ratio` x
    `peers_s`, the median of the other ranks', and it has been slow since `since_step` (the
    last point at which its CUSUM was 0). `drain`: a `Drain` of it comes in the same
    decision; else `reason` says why not."""

    kind: ClassVar[ActionKind] = ActionKind.FLAG
    slot: int
    node: int
    step: int
    since_step: int
    ratio: float
    own_s: float
    peers_s: float
    drain: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Clear:
    """The flagged `slot`'s CUSUM is back to 0 at `step`: it runs with its peers again."""

    kind: ClassVar[ActionKind] = ActionKind.CLEAR
    slot: int
    step: int


@dataclass(frozen=True)
class Drain:
    """Drain `slot` onto a ready spare (the caller reports instead when none is ready)."""

    kind: ClassVar[ActionKind] = ActionKind.DRAIN
    slot: int
    step: int


@dataclass(frozen=True)
class JobSlow:
    """Every slot is slower than its own baseline at `step`, by `ratio` (the median over the
    slots): the job slowed as a whole. Report only."""

    kind: ClassVar[ActionKind] = ActionKind.JOB_SLOW
    step: int
    ratio: float


Action = Flag | Clear | Drain | JobSlow


@dataclass(frozen=True)
class Track:
    """One slot's detector state."""

    node: int
    """The node its rank ran on at the last point; another node starts a fresh track."""
    cusum: float = 0.0
    """The CUSUM of its log-ratio to its peers."""
    since_step: int = 0
    """The step of the last point at which `cusum` was 0 (meaningful while it is above 0)."""
    flagged: bool = False
    drained: bool = False
    """A `Drain` of it was issued while this flag stands."""
    history: tuple[float, ...] = ()
    """Its m values after warm-up, until the baseline is taken from them."""
    baseline: float | None = None
    """The median of its first BASELINE_POINTS m values; None until then."""
    slowed: float = 0.0
    """The CUSUM of its log-ratio to its own baseline."""


@dataclass(frozen=True)
class StragglerState:
    warmup_left: int
    """Points still to pass over before anything is updated."""
    tracks: dict[int, Track] = field(default_factory=dict)
    """By slot; never changed in place (`decide` returns a new dict)."""
    last_step: int | None = None
    """The step of the previous point since the last reset."""
    last_drain: int | None = None
    """The step of the last `Drain` issued; kept across resets."""
    job_slow: bool = False
    """A `JobSlow` was emitted and not every own-history CUSUM is back to 0 yet."""


def initial(config: StragglerConfig) -> StragglerState:
    """The state at a job's start: warm-up ahead, nothing learned."""
    return StragglerState(warmup_left=config.warmup)


def reset(state: StragglerState, config: StragglerConfig) -> StragglerState:
    """After a start, a generation switch, a rollback or a drain: warm-up again; every CUSUM,
    flag, baseline and the job-wide alarm forgotten; the last drain's step kept (cooldown)."""
    return StragglerState(warmup_left=config.warmup, last_drain=state.last_drain)


def summary(config: StragglerConfig) -> str:
    """One line on the detector, for the start event."""
    if not config.enabled:
        return "stragglers: off"
    remedy = (f"drain (cooldown {config.cooldown} steps)"
              if config.remedy == StragglerRemedy.DRAIN else "report")
    return (f"stragglers: CUSUM on own step time vs peers, every {config.batch} steps, tuned "
            f"for {config.target_ratio:g}x, flag at {config.threshold:g} and >= "
            f"{config.min_ratio:g}x, warm-up {config.warmup} points; remedy {remedy}")


def _median(xs: Iterable[float]) -> float:
    s = sorted(xs)
    h = len(s) // 2
    return s[h] if len(s) % 2 else (s[h - 1] + s[h]) / 2


def peer_medians(ms: list[float]) -> list[float]:
    """For each entry, the median of the *other* entries (at least 2 entries)."""
    order = sorted(range(len(ms)), key=ms.__getitem__)
    s = [ms[i] for i in order]
    n = len(s) - 1  # the size of each leave-one-out list
    h = n // 2
    out = [0.0] * len(s)
    for pos, i in enumerate(order):
        # the leave-one-out list is s without s[pos]: its j-th is s[j] below pos, s[j+1] above
        hi = s[h] if h < pos else s[h + 1]
        if n % 2:
            out[i] = hi
        else:
            lo = s[h - 1] if h - 1 < pos else s[h]
            out[i] = (lo + hi) / 2
    return out


def own_medians(own_rows: Iterable[Sequence[float]]) -> list[float]:
    """Each rank's m: the median of its own times, at least FLOOR_S."""
    return [max(FLOOR_S, _median(row)) for row in own_rows]


def point_ratio(own_rows: Iterable[Sequence[float]]) -> list[float]:
    """Each rank's ratio to its peers: its m over the median of the others' m. With fewer
    than 2 rows there are no peers, and every ratio is 1."""
    ms = own_medians(own_rows)
    if len(ms) < 2:
        return [1.0] * len(ms)
    return [m / p for m, p in zip(ms, peer_medians(ms), strict=True)]


def _cusum(s: float, log_ratio: float, k: float, c: float, cap: float) -> float:
    """One CUSUM step: s + clip(log_ratio, -c, c) - k, kept within [0, cap]."""
    x = log_ratio if -c <= log_ratio <= c else (c if log_ratio > c else -c)
    s += x - k
    return 0.0 if s <= 0.0 else (s if s < cap else cap)


def _check(point: Point) -> None:
    n = len(point.slots)
    if n < 1 or len(point.nodes) != n or len(point.own) != n:
        raise ValueError(f"a point needs one slot, node and row per rank, got "
                         f"{n}, {len(point.nodes)} and {len(point.own)}")
    if len(set(point.slots)) != n or not all(point.own):
        raise ValueError(f"a point needs distinct slots and a time in every row: {point}")


def _drain_hold(state: StragglerState, step: int, config: StragglerConfig) -> str:
    """Why no drain may be issued at `step` ('' when one may)."""
    if config.remedy != StragglerRemedy.DRAIN:
        return "remedy report"
    if state.last_drain is not None and step - state.last_drain < config.cooldown:
        return (f"cooldown: the last drain was at step {state.last_drain}, drains are "
                f"{config.cooldown} steps apart")
    return ""


def decide(state: StragglerState, point: Point,
           config: StragglerConfig) -> tuple[StragglerState, tuple[Action, ...]]:
    """The detector's step on one point: the new state and the actions, in the order Clear,
    Flag (by slot), Drain (at most one), JobSlow. Pure: the same (state, point, config) gives
    the same answer on every rank. Raises ValueError on a malformed point (`Point`)."""
    _check(point)
    if state.warmup_left > 0:
        return replace(state, warmup_left=state.warmup_left - 1, last_step=point.step), ()
    step = point.step
    prev = state.last_step if state.last_step is not None else step - config.batch
    delta = math.log(config.target_ratio)
    k, c = delta / 2, 1.25 * delta
    threshold, cap = config.threshold, CAP * config.threshold
    ms = own_medians(point.own)
    n = len(ms)
    peers = peer_medians(ms) if n >= 2 else ms
    old = state.tracks
    tracks: dict[int, Track] = {}
    clears: list[Action] = []
    flags: list[Flag] = []
    pending: list[tuple[float, int]] = []  # (-ratio, slot): flagged, not drained, still slow
    all_slowed = n > 0
    job_ratios: list[float] = []
    for i, slot in enumerate(point.slots):
        node, m = point.nodes[i], ms[i]
        t = old.get(slot)
        if t is None or t.node != node:
            t = Track(node=node)
        # own history
        history, baseline, slowed = t.history, t.baseline, t.slowed
        if baseline is None:
            history = history + (m,)
            if len(history) >= BASELINE_POINTS:
                baseline, history = _median(history), ()
            all_slowed = False
        else:
            own_ratio = m / baseline
            slowed = _cusum(slowed, math.log(own_ratio), k, c, cap)
            job_ratios.append(own_ratio)
            if slowed < threshold:
                all_slowed = False
        # against the peers
        cusum, since, flagged, drained = t.cusum, t.since_step, t.flagged, t.drained
        if n >= 2:
            ratio = m / peers[i]
            rose = cusum == 0.0
            cusum = _cusum(cusum, math.log(ratio), k, c, cap)
            if rose and cusum > 0.0:
                since = prev  # the previous point is the last at which it was 0
            if flagged and cusum == 0.0:
                clears.append(Clear(slot=slot, step=step))
                flagged = drained = False
            elif not flagged and cusum >= threshold and ratio >= config.min_ratio:
                flagged = True
                flags.append(Flag(slot=slot, node=node, step=step, since_step=since,
                                  ratio=ratio, own_s=m, peers_s=peers[i]))
            if flagged and not drained and ratio >= config.min_ratio:
                pending.append((-ratio, slot))
        if (t.baseline is None or cusum != t.cusum or flagged != t.flagged
                or slowed != t.slowed):  # since_step and drained change only with these
            t = Track(node, cusum, since, flagged, drained, history, baseline, slowed)
        tracks[slot] = t
    actions: list[Action] = clears
    last_drain, drained_slot = state.last_drain, None
    hold = _drain_hold(state, step, config) if pending else ""  # every new flag is pending
    if pending and not hold:
        drained_slot = min(pending)[1]  # the slowest; the lowest slot on a tie
        tracks[drained_slot] = replace(tracks[drained_slot], drained=True)
        last_drain = step
    for f in flags:
        actions.append(replace(f, drain=True) if f.slot == drained_slot else replace(
            f, reason=hold or f"one drain a point: slot {drained_slot} drained"))
    if drained_slot is not None:
        actions.append(Drain(slot=drained_slot, step=step))
    job_slow = state.job_slow
    if job_slow and all(t.slowed == 0.0 for t in tracks.values()):
        job_slow = False
    elif not job_slow and all_slowed and _median(job_ratios) >= config.min_ratio:
        job_slow = True
        actions.append(JobSlow(step=step, ratio=_median(job_ratios)))
    new = StragglerState(warmup_left=0, tracks=tracks, last_step=step, last_drain=last_drain,
                         job_slow=job_slow)
    return new, tuple(actions)
