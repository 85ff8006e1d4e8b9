"""The Prometheus metric names the leader's agent serves on `/metrics`, declared once.

telemetry/grafana/unbroken.json is built on these names; tests check that every name the
dashboard queries is declared here. A histogram or counter exposes the usual suffixes
(`_bucket`, `_sum`, `_count`, `_total`).
"""

from __future__ import annotations

from enum import StrEnum


class Metric(StrEnum):
    GOODPUT = "unbroken_goodput_ratio"
    """Gauge, 0..1: productive step time over wall time times world size, so far."""
    BADPUT = "unbroken_badput_seconds"
    """Gauge, label `category` (telemetry.categories): seconds per rank, so far."""
    WALL = "unbroken_wall_seconds"
    """Gauge: seconds since the job started."""
    STEP = "unbroken_step"
    """Gauge: steps committed so far (the number of the next step to run)."""
    STEPS = "unbroken_steps"
    """Counter (`_total`): step computations reported by rank 0's slot, redone ones included."""
    STEP_TIME = "unbroken_step_seconds"
    """Histogram: step durations as rank 0's slot reports them."""
    FAULTS = "unbroken_faults"
    """Counter (`_total`), label `kind`: faults by kind (crash, hang, exception, ...)."""
    ANOMALIES = "unbroken_anomalies"
    """Counter (`_total`), label `kind`: what the anomaly detectors found: `nan`, `inf`,
    `spike` (classified after the rerun), `sdc` (replicas disagreed), `straggler` (flagged)."""
    RECOVERY_TIME = "unbroken_recovery_seconds"
    """Histogram: in-place recoveries, from the generation breaking to the next one up."""
    RESTARTS = "unbroken_restarts"
    """Counter (`_total`): full restarts of every worker."""
    CHECKPOINT_STALL = "unbroken_checkpoint_stall_seconds"
    """Histogram: the training loop's stall per checkpoint (rank 0's slot)."""
    CHECKPOINT_DURABLE = "unbroken_checkpoint_durable_seconds"
    """Histogram: from a checkpoint's start to its commit on storage (rank 0's slot)."""
    SPARES_READY = "unbroken_spares_ready"
    """Gauge: hot spares warmed up and not yet promoted."""
    WORLD_SIZE = "unbroken_world_size"
    """Gauge: ranks in the running generation."""
    EVENTS_DROPPED = "unbroken_events_dropped"
    """Counter (`_total`): events the log could not store (a full disk), as reported."""
