"""The Prometheus metric names the agents serve on `/metrics`, and the recording rules
built on them, declared once.

Every agent (leader, follower, standby node) serves its node's `unbroken_node_*` series:
monotonic counters of what its own workers and its own agent recorded, labelled `node` and
never by rank; sum them over nodes for the job. The leader's agent also serves the older
job-wide series (`unbroken_goodput_ratio` ... `unbroken_events_dropped`), computed from
the events it can read: kept for one release, then removed; the recording rules
(`RecordingRule`, deploy/prometheus/unbroken-rules.yml) replace them. The Grafana
dashboard (telemetry/grafana/unbroken.json) and the alerts query the rules; tests check
that every name they use is declared here. A histogram or counter exposes the usual
suffixes (`_bucket`, `_sum`, `_count`, `_total`).
"""

from __future__ import annotations

from enum import StrEnum

NODE_LABEL = "node"
"""The label every `unbroken_node_*` series carries: the agent's node rank."""


class Metric(StrEnum):
    NODE_INFO = "unbroken_node_info"
    """Gauge, always 1, labels `node`, `role` (`leader`, `follower`, `standby`) and `run`:
    the agent is up. Every agent serves it, so every target Prometheus scrapes answers."""
    NODE_START = "unbroken_node_start_time_seconds"
    """Gauge, label `node`: when the agent started (Unix time)."""
    NODE_RANK_SECONDS = "unbroken_node_rank_seconds"
    """Counter (`_total`), labels `node`, `category` (telemetry.categories): the node's
    rank-seconds by goodput category, as the goodput accounting charges them, counted once
    they are settled (every held slot's events cover them, or `node_metrics.SETTLE_S` ago)."""
    NODE_STEPS = "unbroken_node_steps"
    """Counter (`_total`), label `node`: step computations by the node's ranks (each rank's
    step counts once; redone ones included)."""
    NODE_FAULTS = "unbroken_node_faults"
    """Counter (`_total`), labels `node`, `kind`: faults the node's agent recorded (its
    workers' crashes, hangs, exceptions; the leader's: lost nodes); every kind starts at 0."""
    NODE_RECOVERIES = "unbroken_node_recoveries"
    """Counter (`_total`), labels `node`, `kind` (`in_place`, `restart`): generations the
    node's workers joined after leaving one, and attempts after the first it started workers
    for. Every node takes part in each: take the maximum over nodes for the job's."""
    NODE_SWITCH_TIME = "unbroken_node_switch_seconds"
    """Histogram, label `node`: each of the node's workers' switch into a new generation,
    from leaving the old one to ready to train."""
    NODE_CHECKPOINT_STALL = "unbroken_node_checkpoint_stall_seconds"
    """Counter (`_total`), label `node`: rank-seconds the node's training loops stalled for
    checkpoints."""
    JOB_CAPACITY_LOST = "unbroken_job_capacity_lost_rank_seconds"
    """Counter (`_total`), the leader's only: rank-seconds the job ran short of its full
    world (ranks no live node holds); a new leader resumes it (`job_ledger`)."""
    JOB_GENERATION = "unbroken_job_generation"
    """Gauge, the leader's only: the newest generation up."""
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


DEPRECATED: dict[Metric, str] = {
    Metric.GOODPUT: "job:unbroken_goodput:ratio_rate5m",
    Metric.BADPUT: "job:unbroken_rank_seconds:rate5m (and unbroken_node_rank_seconds_total)",
    Metric.STEPS: "job:unbroken_steps:rate5m (every rank's, not rank 0's)",
    Metric.FAULTS: "unbroken_node_faults_total, summed over nodes",
}
"""The leader's series that the node series and the rules replace, with what replaces each:
still served for one release, no longer on the dashboard or in the alerts."""


class RecordingRule(StrEnum):
    """The recording rules of deploy/prometheus/unbroken-rules.yml (by `job`, the scrape job
    that names the run). Nothing newer than Prometheus 2.42."""

    RANK_SECONDS_RATE = "job:unbroken_rank_seconds:rate5m"
    """Rank-seconds per second by `category`, summed over the job's nodes."""
    GOODPUT = "job:unbroken_goodput:ratio_rate5m"
    """The job's goodput over the last 5 minutes: productive over all rank-seconds."""
    STEPS_RATE = "job:unbroken_steps:rate5m"
    """Step computations per second, summed over the job's ranks."""
    FAULTS = "job:unbroken_faults:increase1h"
    """Faults in the last hour by `kind`, summed over nodes."""
    RECOVERIES = "job:unbroken_recoveries:increase1h"
    """Recoveries in the last hour by `kind` (the most any node took part in)."""
