"""Numerical anomalies: NaN, Inf and loss spikes, judged at the step they happen (pure).

Every rank contributes `[loss, grad_sq, batch]` for the step, after backward and before the
update; the executor (`runtime/anomalies/anomaly_duty.py`) gathers them, so every rank holds the same
`Sample` and, from the same `NumericsState`, reaches the same verdict: a NaN on any rank
skips the step on every rank, with no second agreement round.

- **Non-finite:** a rank's loss or its local gradients' squared norm is NaN or Inf.
- **Spike:** with `L` the ranks' mean loss and `W` the accepted steps' mean losses (at most
  `window`, at least `min_history`), `z = (L - med W) / (1.4826 MAD W + 1e-3 |med W|)` is at
  least `spike_z` and `L` exceeds the median by `spike_rise` of it. One-sided: a falling loss
  (the normal trend) never fires. The relative floor keeps a late, tiny MAD from flagging
  noise. Megatron instead compares with 10x the largest of the first losses, which misses the
  late spikes of a loss that has fallen; a sliding median adapts.
- **Classification, by a rerun** (as Megatron's rerun state machine does): the first finding
  at a step is `RERUN`: nothing is committed and the step runs again on the same data with
  the same seed. Reproduced (the same non-finite ranks, the losses within `rerun_rtol`):
  the data or the model (`DATA`), and the remedy runs. Not reproduced: a transient fault, the
  hardware (`HARDWARE`): the clean rerun is committed and the executor checks the replicas.
- **Remedy** (`Remedy`): skip the step and `skip_after` more batches; or roll back to the
  host copy, passing over them; or report only.
- **Limit:** `max_anomalies` findings within `anomaly_window` steps stop the job (exit 1).

The state follows the training timeline: it is a tracked extra (`Ledger`), so checkpoints,
host copies and peers carry it. Loading it *restores* the loss window (a rollback or a joiner
gets the window of the state it loads) and *merges* the skip set and the ledger (neither a
rollback nor a joiner may forget a skipped batch or a finding).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from enum import StrEnum

from unbroken.runtime.config import NumericsConfig, Remedy


class Verdict(StrEnum):
    """What a step does after `Engine.check`: the loop obeys it."""

    COMMIT = "commit"
    """Make the update and commit the step."""
    RERUN = "rerun"
    """The engine dropped the step: run it again (the same step, data and seed)."""
    SKIPPED = "skipped"
    """The engine passed over the step: no update; go on to the next step."""
    ROLLED_BACK = "rolled_back"
    """The engine rolled the state back: go on from the step it now stands at."""


class Kind(StrEnum):
    NAN = "nan"
    INF = "inf"
    SPIKE = "spike"


class Cause(StrEnum):
    DATA = "data"
    """Reproduced on the rerun: the batch or the model."""
    HARDWARE = "hardware"
    """Not reproduced: a transient fault of a device, handled as silent data corruption."""


@dataclass(frozen=True)
class Sample:
    """One step's numbers, one entry per rank (identical on every rank once gathered)."""

    step: int
    losses: tuple[float, ...]
    """Each rank's loss; None: the rank logged none."""
    grad_sq: tuple[float, ...]
    """Each rank's local gradients' squared L2 norm."""
    batches: tuple[float | None, ...] = ()
    """Each rank's batch id (the `data` metric), for the report."""

    def bad_ranks(self) -> tuple[int, ...]:
        """Ranks whose own loss is non-finite, else those whose gradients are."""
        by_loss = tuple(r for r, x in enumerate(self.losses) if x is not None and not math.isfinite(x))
        return by_loss or tuple(r for r, g in enumerate(self.grad_sq) if not math.isfinite(g))

    def mean_loss(self) -> float | None:
        values = [x for x in self.losses if x is not None]
        return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Entry:
    """One anomaly in the ledger."""

    step: int
    kind: Kind
    cause: Cause
    batches: tuple[float | None, ...] = ()


@dataclass(frozen=True)
class Pending:
    """A finding awaiting its rerun."""

    step: int
    kind: Kind
    ranks: tuple[int, ...]
    losses: tuple[float | None, ...]


@dataclass(frozen=True)
class NumericsState:
    window: tuple[float, ...] = ()
    """The accepted steps' mean losses, oldest first."""
    pending: Pending | None = None
    skips: frozenset[int] = frozenset()
    """Steps whose batches are passed over."""
    ledger: tuple[Entry, ...] = ()


# ---------------------------------------------------------------- actions
@dataclass(frozen=True)
class Found:
    step: int
    kind: Kind
    loss: float | None
    score: float | None
    ranks: tuple[int, ...]
    rerun: bool
    """True: a rerun follows; False: this was the rerun."""


@dataclass(frozen=True)
class Classified:
    step: int
    kind: Kind
    cause: Cause
    reproduced: bool
    first: float | None
    again: float | None
    tolerance: float
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Stop:
    """Too many anomalies: the job ends (exit 1)."""

    entries: tuple[Entry, ...]
    limit: int
    window: int


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    found: Found | None = None
    classified: Classified | None = None
    rollback: bool = False
    """The verdict is a rollback: the executor restores the host copy (SKIPPED if none)."""
    stop: Stop | None = None
    hardware: bool = False
    """A transient fault: the executor checks the replicas now."""


def spike_score(window: tuple[float, ...], loss: float, config: NumericsConfig) -> float | None:
    """The robust score of `loss` against `window`, or None with too little history."""
    if len(window) < config.min_history:
        return None
    med = statistics.median(window)
    mad = statistics.median(abs(x - med) for x in window)
    return (loss - med) / (1.4826 * mad + 1e-3 * abs(med) + 1e-12)


def finding(state: NumericsState, sample: Sample, config: NumericsConfig
            ) -> tuple[Kind | None, float | None]:
    """What, if anything, is wrong with `sample`, and its spike score."""
    values = [x for x in sample.losses if x is not None] + list(sample.grad_sq)
    if any(math.isnan(x) for x in values):
        return Kind.NAN, None
    if any(math.isinf(x) for x in values):
        return Kind.INF, None
    loss = sample.mean_loss()
    if loss is None:
        return None, None
    score = spike_score(state.window, loss, config)
    if score is None:
        return None, None
    med = statistics.median(state.window)
    if score >= config.spike_z and loss - med >= config.spike_rise * abs(med):
        return Kind.SPIKE, score
    return None, score


def _same(first: tuple[float | None, ...], again: tuple[float | None, ...], rtol: float) -> bool:
    if len(first) != len(again):
        return False
    for a, b in zip(first, again, strict=True):
        if a is None or b is None:
            if a is not b:
                return False
        elif math.isnan(a) or math.isnan(b):
            if not (math.isnan(a) and math.isnan(b)):
                return False
        elif a != b and not (rtol and abs(a - b) <= rtol * max(abs(a), abs(b))):
            return False
    return True


def decide(state: NumericsState, sample: Sample, config: NumericsConfig
           ) -> tuple[NumericsState, Decision]:
    """The verdict on `sample`'s step, and the state after it. Identical on every rank."""
    kind, score = finding(state, sample, config)
    loss = sample.mean_loss()
    pending = state.pending if state.pending is not None and state.pending.step == sample.step \
        else None
    if pending is None:
        state = replace(state, pending=None)  # a rerun that never came (a recovery moved on)
        if kind is None:
            return _accept(state, loss, config), Decision(Verdict.COMMIT)
        found = Found(sample.step, kind, loss, score, sample.bad_ranks(), rerun=True)
        return (replace(state, pending=Pending(sample.step, kind, sample.bad_ranks(),
                                               sample.losses)),
                Decision(Verdict.RERUN, found=found))
    # This is the rerun of a finding.
    state = replace(state, pending=None)
    reproduced = (kind == pending.kind and sample.bad_ranks() == pending.ranks
                  and _same(pending.losses, sample.losses, config.rerun_rtol))
    cause = Cause.DATA if reproduced else Cause.HARDWARE
    classified = Classified(sample.step, pending.kind, cause, reproduced,
                            _mean(pending.losses), loss, config.rerun_rtol, pending.ranks)
    found = Found(sample.step, kind, loss, score, sample.bad_ranks(), rerun=False) \
        if kind is not None else None
    entry = Entry(sample.step, pending.kind, cause, sample.batches)
    if all((e.step, e.kind) != (entry.step, entry.kind) for e in state.ledger):  # a replay's
        state = replace(state, ledger=state.ledger + (entry,))  # again: counted once, as merged
    stop = _limit(state, sample.step, config)
    if kind is None:  # a transient fault: the clean rerun is committed
        return (_accept(state, loss, config),
                Decision(Verdict.COMMIT, found=found, classified=classified, stop=stop,
                         hardware=True))
    if config.remedy == Remedy.REPORT and cause == Cause.DATA:
        return state, Decision(Verdict.COMMIT, found=found, classified=classified, stop=stop)
    skips = frozenset(range(sample.step, sample.step + 1 + config.skip_after))
    state = replace(state, skips=state.skips | skips)
    rollback = config.remedy == Remedy.ROLLBACK
    return state, Decision(Verdict.ROLLED_BACK if rollback else Verdict.SKIPPED, found=found,
                           classified=classified, rollback=rollback, stop=stop,
                           hardware=cause == Cause.HARDWARE)


def _mean(losses: tuple[float | None, ...]) -> float | None:
    values = [x for x in losses if x is not None]
    return sum(values) / len(values) if values else None


def _accept(state: NumericsState, loss: float | None, config: NumericsConfig) -> NumericsState:
    """The step is committed: its mean loss joins the window."""
    if loss is None or not math.isfinite(loss):
        return state
    return replace(state, window=(state.window + (loss,))[-config.window:])


def _limit(state: NumericsState, step: int, config: NumericsConfig) -> Stop | None:
    """The data's findings (reproduced) within the window; a device's (not reproduced) are
    silent data corruption's to handle, not a reason to end the job."""
    recent = tuple(e for e in state.ledger if e.step > step - config.anomaly_window
                   and e.cause == Cause.DATA)
    if len(recent) >= config.max_anomalies:
        return Stop(recent, config.max_anomalies, config.anomaly_window)
    return None


def report(stop: Stop) -> str:
    """One line naming the steps, kinds and batches that stopped the job."""
    parts = []
    for e in stop.entries:
        batches = ",".join("-" if b is None else f"{int(b)}" for b in e.batches)
        parts.append(f"step {e.step} ({e.kind}, {e.cause}, batches {batches or '-'})")
    return (f"{len(stop.entries)} numerical anomalies within {stop.window} steps "
            f"(limit {stop.limit}): " + "; ".join(parts))


# ---------------------------------------------------------------- the tracked extra
def to_json(state: NumericsState) -> str:
    return json.dumps({"window": list(state.window), "skips": sorted(state.skips),
                       "ledger": [[e.step, e.kind, e.cause, list(e.batches)]
                                  for e in state.ledger]})


def merged(state: NumericsState, text: str) -> NumericsState:
    """`state` after loading `text` (`to_json`'s): the window restored, the skip set and the
    ledger merged, no finding pending."""
    saved = json.loads(text)
    ledger = {(e.step, e.kind): e for e in state.ledger}
    for step, kind, cause, batches in saved["ledger"]:
        ledger.setdefault((step, Kind(kind)), Entry(step, Kind(kind), Cause(cause),
                                                    tuple(batches)))
    return NumericsState(window=tuple(saved["window"]), pending=None,
                         skips=state.skips | frozenset(saved["skips"]),
                         ledger=tuple(sorted(ledger.values(), key=lambda e: e.step)))
