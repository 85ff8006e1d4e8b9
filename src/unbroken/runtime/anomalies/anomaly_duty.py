"""The anomaly detectors' executor: it gathers what the pure policies judge, records their
findings as events, and hands the engine its verdict. Main thread only.

The policies are pure (`runtime/anomalies/numerics.py`, `runtime/anomalies/replicas.py`,
`runtime/anomalies/stragglers.py`); this module does their I/O: one collective per check, events
from rank 0 for what is job-wide. What the verdict asks of the step (drop it, skip it, roll
back) is the engine's to do (`Engine.check`), where the position changes hands.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from unbroken.errors import JobStopped
from unbroken.runtime.anomalies import numerics
from unbroken.runtime.anomalies.checksum import local_tensor
from unbroken.runtime.anomalies.gather import gather
from unbroken.runtime.anomalies.numerics import Decision, NumericsState, Sample
from unbroken.runtime.config import AnomalyConfig, Remedy, SdcRemedy
from unbroken.telemetry import schema as ev

if TYPE_CHECKING:
    from unbroken.runtime.anomalies.replica_checks import ReplicaChecks, ReplicaVerdict
    from unbroken.runtime.anomalies.straggler_watch import StragglerWatch
    from unbroken.runtime.position import Position
    from unbroken.runtime.tracked import TrackedState

LEDGER = "_unbroken_anomalies"
"""The name of the numerics ledger among the tracked extras."""
SCHEDULE = "_unbroken_replica_checks"
"""The name of the replica checks' schedule among the tracked extras."""


class Ledger:
    """The numerics policy's state, tracked with the training state (`run.track`'s
    extras): checkpoints, host copies and peers carry it. Loading restores the loss window
    and merges the skip set and the findings (`numerics.merged`)."""

    def __init__(self) -> None:
        self.state = NumericsState()

    def state_dict(self) -> dict[str, str]:
        return {"json": numerics.to_json(self.state)}

    def load_state_dict(self, saved: dict[str, str]) -> None:
        self.state = numerics.merged(self.state, saved["json"])


def local_numbers(params: Iterable[torch.Tensor], metrics: dict[str, Any]) -> torch.Tensor:
    """This rank's `[loss, has loss, gradients' squared norm, batch id]` as float64, on the
    gradients' device (one read of the gradients; no host sync)."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    loss, batch = metrics.get("loss"), metrics.get("data")
    vec = torch.tensor([0.0 if loss is None else float(loss), 0.0 if loss is None else 1.0,
                        0.0, -1.0 if batch is None else float(batch)],
                       dtype=torch.float64, device=device)
    if grads:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        vec[2] = torch.stack(norms).double().square().sum()
    return vec


def to_sample(step: int, rows: list[list[float]]) -> Sample:
    return Sample(step=step,
                  losses=tuple(r[0] if r[1] else None for r in rows),
                  grad_sq=tuple(r[2] for r in rows),
                  batches=tuple(None if r[3] < 0 else r[3] for r in rows))


class AnomalyDuty:
    """Runs the detectors the config turns on, for one worker's engine."""

    def __init__(self, config: AnomalyConfig, emit: ev.Emit,
                 file_drain: Callable[[int], bool] | None = None) -> None:
        """`file_drain(slot)`: ask the leader to move a slot onto a ready spare. On a GPU
        outside deterministic mode a rerun is not bit-identical: with no `rerun_rtol` given,
        it is compared within 1e-3 (`anomaly_config` says which)."""
        n = config.numerics
        if n.enabled and not n.rerun_rtol and torch.cuda.is_available() \
                and not torch.are_deterministic_algorithms_enabled():
            config = replace(config, numerics=replace(n, rerun_rtol=1e-3))
        self.config = config
        self.emit = emit
        self.ledger = Ledger()
        self.asked: set[int] = set()
        """Steps the script asked to pass over (`run.skip_steps`)."""
        self._rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None
        self.replicas: ReplicaChecks | None = None
        """The replica checks (SDC), when on."""
        self.stragglers: StragglerWatch | None = None
        """The straggler detector, when on."""
        if config.sdc.enabled:
            from unbroken.runtime.anomalies.replica_checks import ReplicaChecks

            self.replicas = ReplicaChecks(config.sdc, emit)
        if config.stragglers.enabled:
            from unbroken.runtime.anomalies.straggler_watch import StragglerWatch

            self.stragglers = StragglerWatch(config.stragglers, emit, file_drain)

    @property
    def numerics_on(self) -> bool:
        return self.config.numerics.enabled

    def extras(self) -> dict[str, Any]:
        """What the training state must carry for the detectors (`run.track`'s extras)."""
        extras: dict[str, Any] = {LEDGER: self.ledger} if self.numerics_on else {}
        if self.replicas is not None:
            extras[SCHEDULE] = self.replicas
        return extras

    def without_rollback(self, why: str, rank: int) -> None:
        """For a loop that cannot follow a rollback (`why`; before `Engine.start`): the
        numerical anomalies' ROLLBACK remedy becomes SKIP, said once, by rank 0."""
        n, said = self.config.numerics, []
        if n.enabled and n.remedy == Remedy.ROLLBACK:
            self.config = replace(self.config, numerics=replace(n, remedy=Remedy.SKIP))
            said.append("a numerical anomaly's rollback is taken as a skip of its step")
        if self.replicas is not None and self.replicas.config.remedy == SdcRemedy.ROLLBACK:
            self.replicas.config = replace(self.replicas.config, remedy=SdcRemedy.REPORT)
            said.append("replicas that disagree are reported, not rolled back")
        if said and rank == 0:
            print(f"unbroken: {why}: {'; '.join(said)}", file=sys.stderr, flush=True)

    def save_rng(self) -> None:
        """At a step's start, when the loop does not seed it (`seed=None`): the RNG states a
        rerun of the step restores (the CPU's, and CUDA's once initialised)."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._rng = (torch.get_rng_state(), cuda)

    def restore_rng(self) -> None:
        if self._rng is not None:
            cpu, cuda = self._rng
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)

    def switched(self) -> None:
        """A generation switch: a finding awaiting its rerun, and a replica dispute awaiting
        its replay, are forgotten on every rank (a joiner's state, from a peer, has neither),
        so the next verdicts are the same everywhere: judged afresh."""
        self.ledger.state = replace(self.ledger.state, pending=None)
        if self.replicas is not None:  # coverage is decided again by the new world's checks
            r = self.replicas
            r.state, r.covered, r.now = replace(r.state, pending=None), True, False

    def skip_reason(self, step: int) -> str | None:
        """Why `step` is passed over without running, or None if it runs."""
        if step in self.asked:
            return "asked"
        return "anomaly" if step in self.ledger.state.skips else None

    def describe(self) -> ev.AnomalyConfig:
        c = self.config
        n = c.numerics
        return ev.AnomalyConfig(
            numerics=(f"nan/inf every step; spike z>={n.spike_z:g} and +{n.spike_rise:.0%} "
                      f"over the median of {n.window} steps; remedy {n.remedy}; stop after "
                      f"{n.max_anomalies} in {n.anomaly_window} steps") if n.enabled else "off",
            rerun_compare=f"rtol={n.rerun_rtol:g}" if n.rerun_rtol else "exact",
            sdc=self.replicas.describe()[0] if self.replicas is not None else "off",
            sdc_every=self.replicas.describe()[1] if self.replicas is not None else None,
            stragglers=self.stragglers.describe() if self.stragglers is not None else "off")

    def after_commit(self, pos: Position, slot: int, cls: int, node: int,
                     tracked: TrackedState, step_time: float | None, copy_every: int | None,
                     at_copy: bool) -> ReplicaVerdict | None:
        """After committed step `pos.step`, before any copy of it (collective): the replica
        check if one is due (its verdict, else None), then the straggler gather if due.
        `cls`: this rank's replica class (-1: a sharded model whose replica groups are not
        known: no checks); `at_copy`: a host copy of this step follows."""
        verdict = None
        if self.replicas is not None and cls < 0 and self.replicas.covered:
            self.replicas.covered = False  # every rank: the model is the same kind everywhere
            if pos.rank == 0:
                print("unbroken: replica checks are off: this sharded model's replica groups "
                      "are known only with in-place recovery under `unbroken run`",
                      file=sys.stderr, flush=True)
        if self.replicas is not None and self.replicas.due(pos.step, at_copy):
            verdict = self.replicas.check(pos.step, tracked, slot, cls, pos.rank, step_time,
                                          copy_every, at_copy)
        if self.stragglers is not None and (verdict is None or not verdict.rollback):
            self.stragglers.after_commit(pos.step, slot, node, pos.rank)
        return verdict

    # ------------------------------------------------------------ numerics
    def judge(self, step: int, params: list[torch.Tensor], metrics: dict[str, Any],
              gen: int, rank: int) -> Decision:
        """The verdict on `step` (collective: every rank, after backward and before the
        update), its findings recorded. Raises `JobStopped` at the anomaly limit."""
        sample = to_sample(step, gather(local_numbers(params, metrics)))
        state, decision = numerics.decide(self.ledger.state, sample, self.config.numerics)
        self.ledger.state = state
        if rank == 0:
            self._record(decision, gen)
        if decision.stop is not None:
            # Every rank says it: the first to stop ends the job, and the leader may stop the
            # others (rank 0 among them) before they get this far.
            s = decision.stop
            self.emit(ev.AnomalyLimit(steps=[e.step for e in s.entries],
                                      kinds=[str(e.kind) for e in s.entries],
                                      batches=[list(e.batches) for e in s.entries],
                                      limit=s.limit, window=s.window,
                                      report=numerics.report(s)))
            raise JobStopped(numerics.report(s))
        if decision.hardware and self.replicas is not None:
            self.replicas.now = True  # a transient fault: are the replicas still identical?
        return decision

    def _record(self, d: Decision, gen: int) -> None:
        if d.found is not None:
            f = d.found
            self.emit(ev.AnomalyFound(step=f.step, gen=gen, kind=f.kind, loss=_finite(f.loss),
                                      score=_finite(f.score), ranks=list(f.ranks),
                                      rerun=f.rerun))
        if d.classified is not None:
            c = d.classified
            self.emit(ev.AnomalyClassified(step=c.step, kind=c.kind, cause=c.cause,
                                           reproduced=c.reproduced, first=_finite(c.first),
                                           again=_finite(c.again), tolerance=c.tolerance,
                                           ranks=list(c.ranks)))


def _finite(x: float | None) -> float | None:
    """JSON has no NaN: a non-finite number is recorded as None."""
    return x if x is not None and math.isfinite(x) else None
