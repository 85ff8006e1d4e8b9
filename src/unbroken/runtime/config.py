"""The worker's typed configuration: what `unbroken.init()` is given, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass

from unbroken.checkpoint.interval import Schedule
from unbroken.errors import UserError


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
