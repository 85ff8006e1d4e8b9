"""The worker's typed configuration: what `unbroken.init()` is given, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum

from unbroken.checkpoint.interval import Schedule
from unbroken.errors import UserError


class Remedy(StrEnum):
    """What is done about a numerical anomaly (NaN, Inf or a loss spike) that reproduced."""

    SKIP = "skip"
    """The step's update is never made; its batch is passed over; training goes on."""
    ROLLBACK = "rollback"
    """Every rank goes back to the newest host copy of the state (else the newest checkpoint)
    and replays from there, passing over the bad batch."""
    REPORT = "report"
    """Events only: the update is made anyway."""


class SdcRemedy(StrEnum):
    """What is done when replicas that must be identical are not (silent data corruption)."""

    ROLLBACK = "rollback"
    """Every rank rolls back to the last verified copy; the blamed rank is replaced in place."""
    REPORT = "report"
    """Events only; later checkpoints are marked unverified."""


class StragglerRemedy(StrEnum):
    """What is done about a rank persistently slower than its peers."""

    DRAIN = "drain"
    """Its slot is drained onto a ready spare (report only when none is ready)."""
    REPORT = "report"
    """Events only."""


@dataclass(frozen=True)
class NumericsConfig:
    """NaN, Inf and loss spikes, judged every step after backward and before the update."""

    enabled: bool = False
    """Check every step: one all-gather of 4 numbers per rank on the training group."""
    window: int = 100
    """Accepted steps whose mean loss the spike score compares with."""
    min_history: int = 20
    """No spike verdict before the window holds this many steps."""
    spike_z: float = 6.0
    """Robust score (loss minus the window's median, over 1.4826 x its MAD) that flags."""
    spike_rise: float = 0.10
    """...and the loss must also exceed the window's median by this fraction of it."""
    remedy: Remedy = Remedy.SKIP
    """What is done about an anomaly that reproduced on the rerun (the data or the model)."""
    skip_after: int = 0
    """Further batches passed over after an anomalous one (PaLM skipped 200 to 500)."""
    max_anomalies: int = 5
    """This many anomalies within `anomaly_window` steps stop the job (exit 1)."""
    anomaly_window: int = 1000
    """The window, in steps, that `max_anomalies` counts over."""
    rerun_rtol: float = 0.0
    """The rerun reproduces when its losses are within this relative tolerance (0: bitwise,
    as on CPU and in CUDA's deterministic mode)."""

    def __post_init__(self) -> None:
        if self.window < self.min_history or self.min_history < 3:
            raise UserError(f"anomaly window {self.window} must be >= min_history "
                            f"{self.min_history} >= 3")
        if self.max_anomalies < 1 or self.anomaly_window < 1:
            raise UserError("max_anomalies and anomaly_window must be at least 1")
        if self.skip_after < 0 or self.rerun_rtol < 0:
            raise UserError("skip_after and rerun_rtol must be >= 0")


@dataclass(frozen=True)
class SdcConfig:
    """Silent data corruption: replicas' checksums of parameters and optimizer state."""

    enabled: bool = False
    """Compare data-parallel replicas every `every` steps and before every host copy."""
    every: int | None = None
    """K, steps between checks; None: the largest that keeps checks within `budget`."""
    budget: float = 0.005
    """The fraction of step time the checks may take when K is chosen."""
    cap: int = 100
    """K is never larger than this."""
    remedy: SdcRemedy = SdcRemedy.ROLLBACK
    """What is done about a mismatch."""

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise UserError(f"sdc every must be at least 1, got {self.every}")
        if not 0 < self.budget < 1 or self.cap < 1:
            raise UserError("sdc budget must be in (0, 1) and cap at least 1")


@dataclass(frozen=True)
class StragglerConfig:
    """Ranks persistently slower than their peers, from each rank's own compute time."""

    enabled: bool = False
    """Gather every rank's own step times every `batch` steps on the training group."""
    batch: int = 5
    """Steps per point: each rank's point is the median of its own times over them."""
    target_ratio: float = 1.5
    """The slowdown the change-point detector (CUSUM) is tuned for."""
    threshold: float = 0.8
    """The CUSUM alarm level."""
    min_ratio: float = 1.25
    """A flagged rank's newest point must be at least this much slower than its peers'."""
    warmup: int = 4
    """Points ignored after a start, a switch or a rollback."""
    remedy: StragglerRemedy = StragglerRemedy.REPORT
    """What is done about a straggler."""
    cooldown: int = 200
    """Steps between two drains."""

    def __post_init__(self) -> None:
        if self.batch < 1 or self.target_ratio <= 1 or self.min_ratio < 1 or self.threshold <= 0:
            raise UserError("straggler batch >= 1, target_ratio > 1, min_ratio >= 1 and "
                            "threshold > 0 are required")


@dataclass(frozen=True)
class AnomalyConfig:
    """The detectors of what does not crash (docs/anomalies.md)."""

    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    """NaN, Inf and loss spikes."""
    sdc: SdcConfig = field(default_factory=SdcConfig)
    """Silent data corruption between replicas."""
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    """Slow ranks."""

    @property
    def any(self) -> bool:
        return self.numerics.enabled or self.sdc.enabled or self.stragglers.enabled


@dataclass(frozen=True)
class RunConfig:
    checkpoint_dir: str | os.PathLike[str] | None = None
    """Where checkpoints go; None: no checkpoints."""
    checkpoint_every: int | None = None
    """Save every N steps (aligned multiples)."""
    keep_checkpoints: int = 3
    """The newest K checkpoints are kept."""
    backend: str | None = None
    """The process-group backend; None: NCCL on GPU, gloo on CPU."""
    timeout: float = 1800.0
    """Collectives' timeout, in seconds."""
    seed: int | None = 0
    """`train()` seeds torch's RNG from (seed, step, slot) before each step; None: untouched."""
    checkpoint_every_seconds: float | None = None
    """Save every T seconds (turned into steps the ranks agree on)."""
    checkpoint_mtbf_hours: float | None = None
    """Save at the Young/Daly interval for this mean time between failures."""
    keep_every: int | None = None
    """Also keep every checkpoint whose step is a multiple of this."""
    checkpoint_timeout: float = 600.0
    """A save not committed within this is reported and skipped over."""
    snapshot_every: int | None = None
    """Sharded state, in place: an in-memory snapshot every N steps; None: chosen so that
    snapshots cost at most 1 % of step time; 0: no snapshots (HSDP replicas only)."""
    snapshot_replicas: int = 1
    """Sharded state, in place: buddies on other nodes that hold a copy of each snapshot."""
    anomalies: AnomalyConfig = field(default_factory=AnomalyConfig)
    """NaN and spike checks, replica checksums, straggler detection; each off by default."""

    def __post_init__(self) -> None:
        if self.snapshot_every is not None and self.snapshot_every < 0:
            raise UserError(f"snapshot_every must be >= 0, got {self.snapshot_every}")
        if self.snapshot_replicas < 1:
            raise UserError(f"snapshot_replicas must be at least 1, got {self.snapshot_replicas}")
        if self.keep_checkpoints < 1:
            raise UserError(f"keep_checkpoints must be at least 1, got {self.keep_checkpoints}")
        if self.keep_every is not None and self.keep_every < 1:
            raise UserError(f"keep_every must be at least 1, got {self.keep_every}")
        self.schedule()  # a bad interval is a clear error now, not at the first step

    def schedule(self) -> Schedule:
        return Schedule(self.checkpoint_every, self.checkpoint_every_seconds,
                        self.checkpoint_mtbf_hours)


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is told once, at `unbroken.init()`."""

    in_place: bool
    """Recover in place (under `unbroken run`); False: a fault restarts every worker."""
    slot: int
    """The logical slot: the original rank, which a replacement inherits (a spare's is set
    when it is promoted)."""
    wid: str
    """This worker process's id in the generation protocol."""
    spare: bool = False
    """A hot spare: warms up in a sandbox and waits to be promoted."""
    joining: bool = False
    """A spare or a replacement: it joins a planned generation rather than generation 0."""
    seed: int | None = 0
    """Seed torch's RNG from (seed, step, slot) before each step; None: leave it alone."""
    shadow_steps: int = 0
    """A spare's warm-up steps."""
    snapshot_every: int | None = None
    """Sharded state: an in-memory snapshot every N steps (None: automatic; 0: none)."""
    snapshot_replicas: int = 1
    """Sharded state: buddies that hold a copy of each snapshot."""
    local_world: int = 1
    """Workers on this node (snapshot buddies go to other nodes)."""
    timeout: float = 1800.0
    """Collectives' timeout, in seconds."""
    node: int = 0
    """The node this worker runs on (the straggler detector names it)."""
    node_dir: str | None = None
    """This node's run directory under `unbroken run` (flight-recorder dumps go there)."""
    anomalies: AnomalyConfig = field(default_factory=AnomalyConfig)
    """The detectors of what does not crash."""
