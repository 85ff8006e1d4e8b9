"""Every event name of the run's log (`events.jsonl`), declared once.

Each name has exactly one event class, its shape, in `telemetry.schema` (registered with
`@event(Event.NAME)`); docs/events.md is generated from those classes, and
tests/unit/test_event_schema.py checks both. Readers may compare with plain strings: an
`Event` is a `str`. A renamed event's old name stays readable (`RENAMED`).
"""

from __future__ import annotations

from enum import StrEnum


class Event(StrEnum):
    ABORT_ON_NOTICE = "abort_on_notice"
    AGENT_ERROR = "agent_error"
    AGENT_EXIT = "agent_exit"
    AGENT_REJECTED = "agent_rejected"
    AGENT_START = "agent_start"
    CHECKPOINT_DEFERRED = "checkpoint_deferred"
    CHECKPOINT_DIR_NOT_SHARED = "checkpoint_dir_not_shared"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    CHECKPOINT_INVALID = "checkpoint_invalid"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_STUCK = "checkpoint_stuck"
    CLOCK_OFFSET = "clock_offset"
    CONTROL_PLANE_BACK = "control_plane_back"
    CONTROL_PLANE_LOST = "control_plane_lost"
    CONTROL_UNSIGNED = "control_unsigned"
    DEAD_JOB_CLEARED = "dead_job_cleared"
    DEAD_JOB_FOUND = "dead_job_found"
    DEPARTURES_SENT = "departures_sent"
    DRAINED = "drained"
    DRAIN_REFUSED = "drain_refused"
    DRAIN_STARTED = "drain_started"
    EVENTS_DROPPED = "events_dropped"
    EXIT_AFTER_DONE = "exit_after_done"
    FAULT = "fault"
    FAULT_INJECTED = "fault_injected"
    FLIGHT_RECORDER_DUMPED = "flight_recorder_dumped"
    FORK_SERVER_LOST = "fork_server_lost"
    FORGED_MESSAGE = "forged_message"
    GEN_LEAVE = "gen_leave"
    GEN_PLAN = "gen_plan"
    GEN_SWITCH = "gen_switch"
    GEN_UP = "gen_up"
    HANG_BLAMED = "hang_blamed"
    HEALTH_CHECKED = "health_checked"
    IN_PLACE_UNAVAILABLE = "in_place_unavailable"
    JOINER_UNUSED = "joiner_unused"
    LEADER_DEPOSED = "leader_deposed"
    LEADER_ELECTED = "leader_elected"
    LEADER_STEPPED_DOWN = "leader_stepped_down"
    LEAD_HANDED_OVER = "lead_handed_over"
    LEAD_HANDOVER_BLOCKED = "lead_handover_blocked"
    LEASE_LOST = "lease_lost"
    LOADER_MARK_UNPUBLISHED = "loader_mark_unpublished"
    LOADER_POSITIONED = "loader_positioned"
    NODE_DRAINED = "node_drained"
    NODE_LOST = "node_lost"
    NODE_QUARANTINED = "node_quarantined"
    NODE_RETURNED = "node_returned"
    NODE_SET = "node_set"
    NODE_TAKEN_OVER = "node_taken_over"
    NOTICE = "notice"
    PHASE = "phase"
    RECOVERY_FALLBACK = "recovery_fallback"
    RENDEZVOUS = "rendezvous"
    REPLACEMENT_STARTED = "replacement_started"
    RESTART = "restart"
    RESUME = "resume"
    ROLLED_BACK = "rolled_back"
    SHARD_SYNC = "shard_sync"
    SNAPSHOTS_REFUSED = "snapshots_refused"
    SNAPSHOT_CONFIG = "snapshot_config"
    SPARE_ASSIGNED = "spare_assigned"
    SPARE_LOST = "spare_lost"
    SPARE_PROMOTED = "spare_promoted"
    SPARE_READY = "spare_ready"
    SPARE_REQUEST_DECLINED = "spare_request_declined"
    SPARE_STARTED = "spare_started"
    SPARES_OFFERED = "spares_offered"
    STALL = "stall"
    STALL_REPORTED = "stall_reported"
    STEP = "step"
    STEP_DROPPED = "step_dropped"
    MICRO_BATCHES_REPLAYED = "micro_batches_replayed"
    STEP_FAILED = "step_failed"
    SWITCH_FAILED = "switch_failed"
    TRAINING_DONE = "training_done"
    WORKERS_DONE = "workers_done"
    WARM_IMPORTS = "warm_imports"
    WARM_READY = "warm_ready"
    WARM_STARTED = "warm_started"
    WARM_TAKEN = "warm_taken"
    WORKERS_STARTED = "workers_started"
    WORKERS_STOPPED = "workers_stopped"
    WORKER_START = "worker_start"
    ANOMALY_CONFIG = "anomaly_config"
    ANOMALY_FOUND = "anomaly_found"
    ANOMALY_CLASSIFIED = "anomaly_classified"
    ANOMALY_LIMIT = "anomaly_limit"
    STEP_SKIPPED = "step_skipped"
    SDC_CHECK = "sdc_check"
    SDC_MISMATCH = "sdc_mismatch"
    SDC_SETTLED = "sdc_settled"
    STRAGGLER_FLAGGED = "straggler_flagged"
    STRAGGLER_CLEARED = "straggler_cleared"
    STRAGGLER_REMEDIED = "straggler_remedied"
    JOB_SLOW = "job_slow"
    SCRIPT_WATCHED = "script_watched"
    SCRIPT_STEPS = "script_steps"
    SCRIPT_SAVE = "script_save"
    SCRIPT_SAVE_WAIT = "script_save_wait"
    SCRIPT_LOAD = "script_load"


RENAMED: dict[str, Event] = {
    "standby_imports": Event.WARM_IMPORTS,
    "standby_ready": Event.WARM_READY,
    "standby_taken": Event.WARM_TAKEN,
    "standbys_started": Event.WARM_STARTED,
}
"""Old event name -> its name now. A log written before a rename is read under the new
names (`events.parse_lines`, `schema.decode`), so `unbroken report` and `simulate
--from-run` read old run dirs as new ones. "standby" means a standby node only (the
glossary); the fork server's pre-imported interpreter, and the warm interpreters before it,
are "warm"."""


def current(name: str) -> str:
    """`name` as it is called now: a renamed event's new name, any other name unchanged."""
    return RENAMED.get(name, name)
