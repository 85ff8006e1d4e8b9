"""Silent data corruption between replicas: compare their checksums and decide (pure).

Ranks that replicate each other must hold bit-identical parameters and optimizer state after
every step (`runtime/anomalies/checksum.py` says why, and what a checksum cannot see). Every `K` steps
(`interval`, `due`), and at every step whose state is copied to the host (a copy must be
clean to be rolled back to), each rank computes its checksum; the executor gathers them,
with each rank's replica class and logical slot, into a `Sums`, and every rank calls
`decide(state, sums, config)`. It does no I/O and reads no clock: every scenario is a table
test (tests/unit/test_replicas.py).

**Replica classes.** Ranks of one class must agree: under DDP every rank is in class 0;
under HSDP a rank's class is its shard index. A class of one rank is compared with nobody
(pure FSDP has no check at all: `coverage` says so). Each class is judged on its own:

- every member agrees: nothing to say (when every class agrees: `Verified`, and this step's
  state is the newest clean one, `ReplicaState.last_verified`);
- n >= 3 members and one value held by more than n/2 of them: the majority wins and every
  other member is blamed, by slot (`Mismatch(resolution="majority")`). Everyone rolls back
  to the last verified step (the blamed replica's gradients went into everyone's
  all-reduce since: no state after it is clean) and the blamed are replaced;
- 2 members that disagree, or no majority: unresolved. Recomputing tells a transient fault
  from a persistent one, and a spare's third vote tells which replica is persistently wrong:

    stage      the check of step s finds       actions                                next
    ---------  ------------------------------  -------------------------------------  ---------
    -          a class split                   Mismatch(unresolved),                  RECOMPUTE
                                               Rollback(last verified, replay=True)
    RECOMPUTE  every class agrees              Mismatch(recompute), Settled(transient  -
                                               =True, by=recompute), Verified(s)
    RECOMPUTE  slots a < b still split,        the vote, below (the spare computed    -
               `spare_sum` given               beside them; b is still in the run)
    RECOMPUTE  a < b still split, a spare is   Mismatch(unresolved), NeedVote(b),     VOTE
               ready (`spare_ready`)           Rollback(last verified, replay=True)
    RECOMPUTE  a < b still split, no spare;    Mismatch(unresolved), Stop             -
               or a split of 3+ replicas
    VOTE       the spare (now slot b) == a     Mismatch(spare, blamed=b), Settled(    -
                                               transient=False, by=spare), Verified(s)
    VOTE       spare == b's old sum, != a      Mismatch(spare, blamed=a), Settled,    -
                                               Rollback(last verified), Replace(a)
    VOTE       spare agrees with neither       Mismatch(unresolved), Stop             -

  The replay reaches step s again and must check there (`ReplicaState.pending.step`). A
  check at a later step drops the pending dispute (the executor skipped the re-check: that
  check is judged afresh). A vote that blames a slot still in the run replaces it and rolls
  everyone back; a vote that blames the drained process leaves a clean state: verified.

**Remedy.** `SdcRemedy.ROLLBACK` is the above. `SdcRemedy.REPORT`: `Mismatch` actions only
(majority blame or "unresolved"), no rollback, no replacement, no recompute; the state
records the first mismatch (`unverified_since`) and nothing is verified after it: every
later host copy and checkpoint is unverified.

**State.** `ReplicaState` follows the job, not the training timeline: the executor keeps it
across the rollbacks it orders (a pending dispute must survive its own replay). An executor
that moves the state back by other means (a checkpoint restore) starts a fresh one, with
`last_verified` the step it restored. `last_verified` None: nothing verified yet; a rollback
then goes to the state the run began from (the executor's oldest copy).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum

from unbroken.runtime.config import SdcConfig, SdcRemedy

Checksum = tuple[int, int]


class Resolution(StrEnum):
    """How a `Mismatch`'s blame was decided."""

    MAJORITY = "majority"
    """More than half of the class agreed; the rest are blamed."""
    RECOMPUTE = "recompute"
    """The replay agreed: a transient fault of the slots whose sums it changed."""
    SPARE = "spare"
    """A spare's recompute, the third vote, agreed with one of two replicas."""
    UNRESOLVED = "unresolved"
    """Nobody can be blamed (yet)."""


class Stage(StrEnum):
    RECOMPUTE = "recompute"
    """Everyone replays from the last verified step; the check at `step` runs again."""
    VOTE = "vote"
    """The higher slot of the pair was drained onto a spare; everyone replays again."""


# ---------------------------------------------------------------- the observation
@dataclass(frozen=True)
class Sums:
    """One check: every rank's checksum, gathered (identical on every rank)."""

    step: int
    sums: tuple[Checksum, ...]
    """Rank r's `checksum.checksum` of its state."""
    classes: tuple[int, ...]
    """Rank r's replica class: ranks of one class must hold identical state."""
    slots: tuple[int, ...]
    """Rank r's logical slot: blame is by slot."""
    spare_sum: Checksum | None = None
    """The third vote: the checksum of a spare that recomputed the disputed step (in the
    VOTE stage it holds the higher slot of the pair; None there: that slot's entry)."""
    spare_ready: bool = False
    """A spare is ready to take a slot for a third vote."""

    def __post_init__(self) -> None:
        if not len(self.sums) == len(self.classes) == len(self.slots):
            raise ValueError(f"{len(self.sums)} sums, {len(self.classes)} classes and "
                             f"{len(self.slots)} slots: one of each per rank")
        if len(set(self.slots)) != len(self.slots):
            raise ValueError(f"slots repeat: {self.slots}")

    def of(self, slot: int) -> Checksum | None:
        """The checksum of `slot`'s rank; None if it has none here."""
        return self.sums[self.slots.index(slot)] if slot in self.slots else None


@dataclass(frozen=True)
class Finding:
    """A class whose members disagree."""

    cls: int
    slots: tuple[int, ...]
    """Its members, by slot, ascending."""
    blamed: tuple[int, ...]
    """The members outside a strict majority; (): no majority (unresolved)."""


def judge(obs: Sums) -> tuple[Finding, ...]:
    """The classes that disagree, by class: a strict majority of n >= 3 members blames the
    rest; 2 members, or no majority, blame nobody."""
    members: dict[int, list[int]] = {}
    for rank, c in enumerate(obs.classes):
        members.setdefault(c, []).append(rank)
    found = []
    for c in sorted(members):
        ranks = sorted(members[c], key=lambda r: obs.slots[r])
        counts = Counter(obs.sums[r] for r in ranks)
        if len(counts) == 1:
            continue
        value, votes = counts.most_common(1)[0]
        blamed = tuple(obs.slots[r] for r in ranks if obs.sums[r] != value) \
            if len(ranks) >= 3 and 2 * votes > len(ranks) else ()
        found.append(Finding(c, tuple(obs.slots[r] for r in ranks), blamed))
    return tuple(found)


def coverage(classes: tuple[int, ...] | list[int]) -> str:
    """What the checks can tell, in words, for ranks whose replica classes are `classes`."""
    sizes = sorted(Counter(classes).values())
    if not sizes or sizes[-1] == 1:
        return "no replicas: every rank's state is its own (pure sharding): nothing to compare"
    alone = sum(1 for n in sizes if n == 1)
    if sizes[0] == sizes[-1]:
        n = sizes[0]
        how = "a majority blames" if n >= 3 else \
            "a disagreement is recomputed, then a spare casts the third vote"
        return f"{len(sizes)} class(es) of {n} replicas: {how}"
    return (f"classes of {sizes[0]} to {sizes[-1]} replicas; {alone} rank(s) alone in "
            "their class, unchecked" if alone else
            f"classes of {sizes[0]} to {sizes[-1]} replicas")


# ---------------------------------------------------------------- state and actions
@dataclass(frozen=True)
class Pending:
    """A dispute nobody could be blamed for, awaiting the replay's check of `step`."""

    step: int
    slots: tuple[int, ...]
    """The members of the split classes (VOTE: the pair; the higher slot is the spare's)."""
    classes: tuple[int, ...]
    sums: tuple[Checksum, ...]
    """`slots`' checksums at the last check of `step`."""
    stage: Stage = Stage.RECOMPUTE


@dataclass(frozen=True)
class ReplicaState:
    """What `decide` remembers between checks (kept across the rollbacks it orders)."""

    last_verified: int | None = None
    """The step of the newest `Verified`: the state every rollback goes back to."""
    pending: Pending | None = None
    unverified_since: int | None = None
    """REPORT: the first step whose check failed; nothing from it on is verified."""


@dataclass(frozen=True)
class Verified:
    """Every class agrees: this step's state is clean (a host copy of it may be kept)."""

    step: int


@dataclass(frozen=True)
class Mismatch:
    """A check found replicas that disagree (an event: one per check of a dispute)."""

    step: int
    clean_step: int | None
    """The last verified step, where a rollback goes."""
    blamed: tuple[int, ...]
    """Slots; (): nobody (yet)."""
    classes: tuple[int, ...]
    resolution: Resolution


@dataclass(frozen=True)
class Rollback:
    """Every rank goes back to the copy of `to_step` (None: the state the run began from)."""

    to_step: int | None
    replay: bool
    """True: a recompute: the check must run again at `ReplicaState.pending.step`."""


@dataclass(frozen=True)
class Replace:
    """These slots' processes die (after the rollback); spares or replacements take over."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class NeedVote:
    """Drain `slot` onto a ready spare for a third vote (then the Rollback that follows)."""

    slot: int


@dataclass(frozen=True)
class Settled:
    """A dispute is over: `transient` (the recompute agreed) or not; decided `by`."""

    step: int
    transient: bool
    by: Resolution


@dataclass(frozen=True)
class Stop:
    """Unresolved, and nothing more to try: the job ends."""

    reason: str


Action = Verified | Mismatch | Rollback | Replace | NeedVote | Settled | Stop


# ---------------------------------------------------------------- the decision
def decide(state: ReplicaState, obs: Sums,
           config: SdcConfig) -> tuple[ReplicaState, list[Action]]:
    """One check's verdict: the new state and the actions, to carry out in order."""
    found = judge(obs)
    if config.remedy is SdcRemedy.REPORT:
        return _report(state, obs, found)
    pending = state.pending
    if pending is not None and obs.step > pending.step:
        state = replace(state, pending=None)  # the re-check never came: judged afresh
    elif pending is not None and obs.step == pending.step:
        if pending.stage is Stage.VOTE:
            return _voted(state, pending, obs, found)
        return _recomputed(state, pending, obs, found)
    if not found:
        return replace(state, last_verified=obs.step), [Verified(obs.step)]
    return _mismatched(state, obs, found)


def _report(state: ReplicaState, obs: Sums,
            found: tuple[Finding, ...]) -> tuple[ReplicaState, list[Action]]:
    if not found:
        if state.unverified_since is not None:
            return state, []
        return replace(state, last_verified=obs.step), [Verified(obs.step)]
    since = obs.step if state.unverified_since is None else min(state.unverified_since,
                                                                obs.step)
    return replace(state, unverified_since=since), _findings(state, obs, found)


def _findings(state: ReplicaState, obs: Sums, found: tuple[Finding, ...]) -> list[Action]:
    """A Mismatch for the classes a majority judged, and one for the unresolved ones."""
    out: list[Action] = []
    judged = [f for f in found if f.blamed]
    split = [f for f in found if not f.blamed]
    if judged:
        out.append(Mismatch(obs.step, state.last_verified, _blamed(judged),
                            tuple(f.cls for f in judged), Resolution.MAJORITY))
    if split:
        out.append(Mismatch(obs.step, state.last_verified, (), tuple(f.cls for f in split),
                            Resolution.UNRESOLVED))
    return out


def _sum(obs: Sums, slot: int) -> Checksum:
    """The checksum of a slot that is in the check."""
    return obs.sums[obs.slots.index(slot)]


def _blamed(found: list[Finding] | tuple[Finding, ...]) -> tuple[int, ...]:
    return tuple(sorted(s for f in found for s in f.blamed))


def _mismatched(state: ReplicaState, obs: Sums,
                found: tuple[Finding, ...]) -> tuple[ReplicaState, list[Action]]:
    """A first look at a disagreement: the majority's blame is final; a split is recomputed."""
    out = _findings(state, obs, found)
    split = [f for f in found if not f.blamed]
    out.append(Rollback(state.last_verified, replay=bool(split)))
    if blamed := _blamed(found):
        out.append(Replace(blamed))
    pending = None
    if split:
        slots = tuple(s for f in split for s in f.slots)
        pending = Pending(obs.step, slots, tuple(f.cls for f in split),
                          tuple(_sum(obs, s) for s in slots))
    return replace(state, pending=pending), out


def _recomputed(state: ReplicaState, pending: Pending, obs: Sums,
                found: tuple[Finding, ...]) -> tuple[ReplicaState, list[Action]]:
    """The replay's check of the disputed step."""
    state = replace(state, pending=None)
    split = [f for f in found if not f.blamed]
    if not split:  # transient: blame the slots whose sums the recompute changed
        changed = tuple(s for s, before in zip(pending.slots, pending.sums, strict=True)
                        if obs.of(s) != before)
        blamed = changed if 0 < len(changed) < len(pending.slots) else ()
        out: list[Action] = [
            Mismatch(obs.step, state.last_verified, blamed, pending.classes,
                     Resolution.RECOMPUTE),
            Settled(obs.step, transient=True, by=Resolution.RECOMPUTE)]
        if found:  # a majority elsewhere blames someone: its own rollback
            state, more = _mismatched(state, obs, found)
            return state, out + more
        return replace(state, last_verified=obs.step), out + [Verified(obs.step)]
    out = _findings(state, obs, found)
    if len(split) > 1 or len(split[0].slots) != 2:
        classes = ", ".join(str(f.cls) for f in split)
        return state, out + [Stop(f"unresolved SDC in replica class(es) {classes}: it "
                                  "persists on recompute, with no majority to blame")]
    a, b = split[0].slots
    if obs.spare_sum is not None:
        return _vote(state, obs, found, split[0], _sum(obs, b), drained=False)
    if not obs.spare_ready:
        return state, out + [Stop(f"unresolved SDC between slots {a} and {b}: no spare to "
                                  "cast the third vote")]
    pair = Pending(obs.step, (a, b), (split[0].cls,),
                   (_sum(obs, a), _sum(obs, b)), Stage.VOTE)
    out += [NeedVote(b), Rollback(state.last_verified, replay=True)]
    if blamed := _blamed(found):
        out.append(Replace(blamed))
    return replace(state, pending=pair), out


def _voted(state: ReplicaState, pending: Pending, obs: Sums,
           found: tuple[Finding, ...]) -> tuple[ReplicaState, list[Action]]:
    """The check of the disputed step after the higher slot was drained onto a spare."""
    state = replace(state, pending=None)
    pair = Finding(pending.classes[0], pending.slots, ())
    return _vote(state, obs, found, pair, pending.sums[1], drained=True)


def _vote(state: ReplicaState, obs: Sums, found: tuple[Finding, ...], pair: Finding,
          old_b: Checksum, drained: bool) -> tuple[ReplicaState, list[Action]]:
    """Decide the pair (a, b) by the spare's sum: agreeing with a blames b (`old_b`: b's
    sum before the spare, if it took b's slot: `drained`), agreeing with b blames a."""
    a, b = pair.slots
    spare = obs.spare_sum if obs.spare_sum is not None else obs.of(b)
    now_a = obs.of(a)
    others = tuple(f for f in found if f.cls != pair.cls)
    clean = state.last_verified
    if spare is not None and now_a is not None and spare == now_a:
        culprit = b
    elif spare is not None and spare == old_b:
        culprit = a
    else:
        why = ("the third vote agrees with neither" if spare is not None and now_a is not None
               else "a vote is missing from the check")
        return state, [*_findings(state, obs, others),
                       Mismatch(obs.step, clean, (), (pair.cls,), Resolution.UNRESOLVED),
                       Stop(f"unresolved SDC between slots {a} and {b}: {why}")]
    out: list[Action] = [Mismatch(obs.step, clean, (culprit,), (pair.cls,), Resolution.SPARE),
                         Settled(obs.step, transient=False, by=Resolution.SPARE)]
    if culprit == b and drained:  # the culprit is gone, and the replay ran without it
        if not others:
            return replace(state, last_verified=obs.step), out + [Verified(obs.step)]
        state, more = _mismatched(state, obs, others)
        return state, out + more
    out += _findings(state, obs, others)
    split = [f for f in others if not f.blamed]
    if split:  # a second dispute while settling one
        return state, out + [Stop(f"unresolved SDC in replica class {split[0].cls} while "
                                  f"slots {a} and {b} were being settled")]
    return state, out + [Rollback(clean, replay=False),
                         Replace(tuple(sorted({culprit, *_blamed(others)})))]


# ---------------------------------------------------------------- when
def interval(check_s: float, step_s: float, copy_every: int | None,
             config: SdcConfig) -> tuple[int, str]:
    """K, the steps between checks, and why: `config.every` if set ("configured"); else the
    least K that keeps the checks within `config.budget` of the step time, counting the
    checks at host-copy steps (`copy_every`; None: none) too:
    K = ceil(check_s / (budget x step_s - check_s / copy_every)), within [1, cap] ("budget",
    or "cap" where the cap cut it); when the copy steps' checks alone spend the budget,
    the cap ("copy-step checks alone exceed the budget")."""
    if config.every is not None:
        return config.every, "configured"
    if check_s < 0 or step_s < 0 or (copy_every is not None and copy_every < 1):
        raise ValueError(f"check {check_s}s, step {step_s}s, copy every {copy_every}: "
                         "times must be >= 0 and copy_every >= 1")
    room = config.budget * step_s - (check_s / copy_every if copy_every else 0.0)
    if room <= 0:
        return config.cap, "copy-step checks alone exceed the budget"
    k = math.ceil(round(check_s / room, 9))  # rounded: 4.000000001 is 4
    if k > config.cap:
        return config.cap, "cap"
    return max(k, 1), "budget"


def due(step: int, last: int | None, every: int, copy_steps: bool) -> bool:
    """A check runs `every` (K) steps after the last one (`last`; None: none yet, counted
    from 0), and at every host-copy step (`copy_steps`: this step's state is copied to the
    host). Counted from the last check, not by multiples of K: K changes as checks are
    timed, and multiples of a changing K fall a step apart (16, then 17)."""
    return copy_steps or step - (last or 0) >= every
