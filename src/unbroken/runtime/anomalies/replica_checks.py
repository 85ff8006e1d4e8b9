"""The replica checks' executor: each rank's checksum gathered, judged by the pure policy
(`runtime/anomalies/replicas.py`), recorded, and turned into what the engine must do. Main thread
only; a check is collective on the training group (every rank, at the same committed step).

When: K steps after the last check, and before every host copy (a checkpoint of a replicated job:
a copy must be verified to be rolled back to), and at once after a numerical anomaly that
its rerun did not reproduce. K is `SdcConfig.every`, else measured: each check's time (the
checksum and the gather, this rank's timer) and the step time give each rank's proposal
(`replicas.interval`), gathered with the sums; every rank takes the largest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from unbroken.errors import JobStopped, SdcGuilty
from unbroken.runtime.anomalies import replicas
from unbroken.runtime.anomalies.checksum import checksum, state_tensors
from unbroken.runtime.anomalies.gather import gather
from unbroken.runtime.anomalies.replicas import ReplicaState, Sums
from unbroken.runtime.config import SdcConfig
from unbroken.runtime.tracked import TrackedState
from unbroken.telemetry import schema as ev

FIRST_EVERY = 10
"""K until the first checks have been timed (or the cap, if lower)."""


@dataclass(frozen=True)
class ReplicaVerdict:
    """What one check asks of the engine, in this order."""

    clean: bool | None
    """The state at this step is verified: a host copy of it may be taken (None: nothing
    to compare it with, no replicas)."""
    rollback: bool = False
    """Every rank rolls back to its newest host copy (verified when it was taken)."""
    replace_me: bool = False
    """This rank is blamed: after the rollback its process must die (`SdcGuilty`)."""
    stop: str | None = None
    """Unresolved: the job must end, with this reason."""

    def error(self, slot: int, step: int, restored: bool) -> Exception | None:
        """What this rank raises after the rollback (`restored`: it found a copy to go back
        to): the job stops (every rank), or this rank's process must go (the blamed one);
        None: go on."""
        if self.stop is not None:
            return JobStopped(self.stop)
        if self.rollback and not restored:
            return JobStopped(
                f"replicas disagreed at step {step} (silent data corruption) and there is no "
                "verified copy to roll back to: give unbroken.init a checkpoint_dir (a "
                "replicated job's host copy is its newest checkpoint's)")
        if self.replace_me:
            return SdcGuilty(f"slot {slot}'s replica disagreed with the majority at step "
                             f"{step}: its process is replaced")
        return None


class ReplicaChecks:
    """One worker's replica checks; `state` follows the job across the rollbacks it orders."""

    def __init__(self, config: SdcConfig, emit: ev.Emit) -> None:
        self.config = config
        self.emit = emit
        self.state = ReplicaState()
        self.every = config.every or min(FIRST_EVERY, config.cap)
        self.why = "configured" if config.every else f"first checks timed (K={self.every})"
        self.covered = True  # False once a gather showed every class of one rank
        self.now = False  # check at the next commit, whatever the schedule
        self.seconds: list[float] = []
        self.last: int | None = None
        """The step of the last check (the same on every rank: checks are collective)."""

    def state_dict(self) -> dict[str, int]:
        """The schedule (K and the last check's step), which every rank must share: a
        tracked extra, so that a joiner checks when its peers do and a rollback takes the
        schedule back with the state. The dispute state (`state`) follows the job instead."""
        return {"every": self.every, "last": -1 if self.last is None else self.last}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.every = int(saved["every"])
        self.last = None if int(saved["last"]) < 0 else int(saved["last"])

    def due(self, step: int, at_copy: bool) -> bool:
        """A check runs after committed `step`: on schedule, before a copy, after a
        hardware finding, and at the step of an open dispute (its replay must check there,
        whatever K became meanwhile)."""
        pending = self.state.pending
        return self.covered and (self.now or replicas.due(step, self.last, self.every, at_copy)
                                 or (pending is not None and pending.step == step))

    def check(self, step: int, tracked: TrackedState, slot: int, cls: int, rank: int,
              step_time: float | None, copy_every: int | None, at_copy: bool) -> ReplicaVerdict:
        """Check committed step `step` (collective). `cls`: this rank's replica class."""
        self.now, self.last = False, step
        t0 = time.perf_counter()
        tensors = state_tensors(tracked.model, tracked.optimizers)
        total, weighted = checksum(tensors)
        proposal = self._proposal(step_time, copy_every)
        rows = gather(torch.tensor([total, weighted, slot, cls, proposal], dtype=torch.int64))
        seconds = time.perf_counter() - t0
        self.seconds.append(seconds)
        sums = Sums(step=step, sums=tuple((r[0], r[1]) for r in rows),
                    classes=tuple(r[3] for r in rows), slots=tuple(r[2] for r in rows))
        if replicas.coverage(sums.classes).startswith("no replicas"):
            self.covered = False  # until the next switch (every rank: the classes are shared)
            return ReplicaVerdict(clean=None)
        if self.config.every is None:  # from the gathered proposals: the same everywhere
            self.every = max(r[4] for r in rows)
        self.state, actions = replicas.decide(self.state, sums, self.config)
        return self._carry_out(actions, sums, seconds, slot, rank, at_copy)

    def _proposal(self, step_time: float | None, copy_every: int | None) -> int:
        if self.config.every is not None or len(self.seconds) < 1 or not step_time:
            return self.every
        # The mean of this rank's recent checks: the budget is about their total time (a
        # median under-counts the slow gathers; the slowest alone held K at the cap).
        recent = self.seconds[-20:]
        check_s = sum(recent) / len(recent)
        k, self.why = replicas.interval(check_s, step_time, copy_every, self.config)
        return k

    def _carry_out(self, actions: list[replicas.Action], sums: Sums, seconds: float,
                   slot: int, rank: int, at_copy: bool) -> ReplicaVerdict:
        ok = not replicas.judge(sums)
        clean = any(isinstance(a, replicas.Verified) for a in actions)
        rollback = replace_me = False
        stop = None
        counts: dict[int, int] = {}
        for c in sums.classes:
            counts[c] = counts.get(c, 0) + 1
        if rank == 0:
            self.emit(ev.SdcCheck(step=sums.step, seconds=round(seconds, 6), ok=ok,
                                  replicas=min(counts.values()), at_copy=at_copy,
                                  every=self.every))
        for a in actions:
            if isinstance(a, replicas.Mismatch) and rank == 0:
                self.emit(ev.SdcMismatch(step=a.step, clean_step=a.clean_step,
                                         blamed=list(a.blamed), resolution=str(a.resolution)))
            elif isinstance(a, replicas.Settled) and rank == 0:
                self.emit(ev.SdcSettled(step=a.step, transient=a.transient, by=str(a.by)))
            elif isinstance(a, replicas.Rollback):
                rollback = True
            elif isinstance(a, replicas.Replace):
                replace_me = replace_me or slot in a.slots
            elif isinstance(a, replicas.NeedVote):
                stop = (f"silent data corruption between two replicas persists at step "
                        f"{sums.step}; a third vote needs a spare to recompute slot {a.slot}, "
                        "which this version does not do")
            elif isinstance(a, replicas.Stop):
                stop = a.reason
        return ReplicaVerdict(clean=clean, rollback=rollback, replace_me=replace_me, stop=stop)

    def describe(self) -> tuple[str, int | None]:
        c = self.config
        k = f"every {c.every} steps" if c.every else (
            f"K chosen from the measured check time for <= {c.budget:.1%} of step time "
            f"(cap {c.cap}; {self.every} until timed)")
        return (f"checksums of parameters and optimizer state across replicas, {k}, and "
                f"before every host copy; remedy {c.remedy}"), c.every
