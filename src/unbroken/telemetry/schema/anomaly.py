"""The anomaly detectors' events: numerical anomalies (NaN, Inf, loss spikes), silent data
corruption between replicas, and stragglers (docs/anomalies.md). Workers write them; a
verdict is collective, so rank 0 writes the job-wide ones and every rank its own skips."""

from __future__ import annotations

from unbroken.telemetry.event_names import Event
from unbroken.telemetry.schema.base import EventBody, doc, event, optional

SECTION = "Anomaly events"


@event(Event.ANOMALY_CONFIG)
class AnomalyConfig(EventBody):
    """At start (rank 0): which detectors run, and how."""

    numerics: str = doc("the NaN and spike check, or `off`")
    rerun_compare: str = doc("how a rerun is compared: `exact` or `rtol=X`")
    sdc: str = doc("the replica check, or `off`, or why it cannot run (`no replicas`)")
    sdc_every: int | None = optional("K: steps between replica checks")
    stragglers: str = doc("the straggler detector, or `off`")


@event(Event.ANOMALY_FOUND)
class AnomalyFound(EventBody):
    """A step's loss or gradients are non-finite, or its loss spiked (rank 0)."""

    step: int = doc("the step")
    gen: int = doc("the generation")
    kind: str = doc("`nan`, `inf` or `spike`")
    loss: float | None = doc("the ranks' mean loss (None: not logged, or non-finite)")
    score: float | None = doc("the spike's robust score, when there is a window")
    ranks: list[int] = doc("the ranks whose own loss (else gradients) were non-finite")
    rerun: bool = doc("a rerun of the step on the same data follows")


@event(Event.ANOMALY_CLASSIFIED)
class AnomalyClassified(EventBody):
    """The rerun of an anomalous step settled its cause (rank 0)."""

    step: int = doc("the step")
    kind: str = doc("what was found the first time")
    cause: str = doc("`data` (it reproduced: the batch or the model) or `hardware` (it did "
                     "not: a transient fault, handled as silent data corruption)")
    reproduced: bool = doc("the rerun gave the same finding")
    first: float | None = doc("the first run's mean loss")
    again: float | None = doc("the rerun's mean loss")
    tolerance: float = doc("the relative tolerance of the comparison (0: bitwise)")
    ranks: list[int] = doc("the ranks it was localised to the first time")


@event(Event.STEP_SKIPPED)
class StepSkipped(EventBody):
    """A step was passed over on every rank: no update was made, its batch is never trained
    on, and the learning-rate schedule did not advance. Each rank writes its own; `extra`
    holds the step's metrics (the example's `data`: its batch id)."""

    step: int = doc("the step")
    gen: int | None = optional("the generation")
    reason: str = doc("`nan`, `inf`, `spike` (an anomaly at this step), `anomaly` (a batch "
                      "passed over by an earlier verdict: after a rollback, or `skip_after`) "
                      "or `asked` (`run.skip_steps`)")


@event(Event.ANOMALY_LIMIT)
class AnomalyLimit(EventBody):
    """Too many anomalies in a window: the job stops, exit 1. Every rank writes it (the
    first to stop ends the job; the others may be stopped before they write it)."""

    steps: list[int] = doc("the anomalous steps in the window")
    kinds: list[str] = doc("their kinds")
    batches: list[list[float | None]] = doc("each step's batch ids, one per rank")
    limit: int = doc("`max_anomalies`")
    window: int = doc("`anomaly_window`, in steps")
    report: str = doc("the one-line report")


@event(Event.SDC_CHECK)
class SdcCheck(EventBody):
    """The replicas' checksums were compared (rank 0)."""

    step: int = doc("the committed step checked")
    seconds: float = doc("this rank's time for the checksum and the gather")
    ok: bool = doc("every replica class agreed")
    replicas: int = doc("replicas per class (the smallest)")
    at_copy: bool = doc("a check before a host copy or checkpoint of this step")
    every: int = doc("K, the steps between checks, in force after this one")


@event(Event.SDC_MISMATCH)
class SdcMismatch(EventBody):
    """Replicas that must be identical are not (rank 0)."""

    step: int = doc("the step checked")
    clean_step: int | None = doc("the last step verified clean")
    blamed: list[int] = doc("the slots blamed (empty: not settled yet)")
    resolution: str = doc("`majority`, `recompute`, `spare` or `unresolved`")


@event(Event.SDC_SETTLED)
class SdcSettled(EventBody):
    """A mismatch between two replicas was settled by replaying from the verified copy."""

    step: int = doc("the step")
    transient: bool = doc("the replay agreed: a transient fault")
    by: str = doc("`recompute` or `spare`")


@event(Event.STRAGGLER_FLAGGED)
class StragglerFlagged(EventBody):
    """A rank is persistently slower than its peers (rank 0)."""

    straggler: int = doc("its slot")
    straggler_node: int | None = doc("its node")
    step: int = doc("the step it was flagged at")
    since_step: int = doc("the estimated onset")
    ratio: float = doc("its own step time over its peers' median")
    own_ms: float = doc("its median own step time, ms")
    peers_ms: float = doc("its peers' median, ms")


@event(Event.STRAGGLER_REMEDIED)
class StragglerRemedied(EventBody):
    """What was done about a straggler."""

    straggler: int = doc("its slot")
    step: int = doc("the step")
    action: str = doc("`drain` (its slot asked to move to a spare) or `report`")
    reason: str = doc("why this action")


@event(Event.STRAGGLER_CLEARED)
class StragglerCleared(EventBody):
    """A flagged rank is no longer slower than its peers."""

    straggler: int = doc("its slot")
    step: int = doc("the step")


@event(Event.JOB_SLOW)
class JobSlow(EventBody):
    """Every rank slowed together against its own history: a job-wide fail-slow (a slow
    link, a throttled fabric), which no drain of one rank can fix. Report only."""

    step: int = doc("the step")
    ratio: float = doc("the slowdown against the ranks' own baseline")
