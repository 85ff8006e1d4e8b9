"""Every event name of the run's log (`events.jsonl`), declared once.

docs/events.md documents each one and its fields; tests/test_control.py checks that the two
agree. Readers may compare with plain strings: an `Event` is a `str`.
"""

from __future__ import annotations

from enum import StrEnum


class Event(StrEnum):
    AGENT_ERROR = "agent_error"
    AGENT_EXIT = "agent_exit"
    AGENT_START = "agent_start"
    CHECKPOINT_DEFERRED = "checkpoint_deferred"
    CHECKPOINT_FAILED = "checkpoint_failed"
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    CHECKPOINT_INVALID = "checkpoint_invalid"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_STUCK = "checkpoint_stuck"
    DRAIN_REFUSED = "drain_refused"
    DRAIN_STARTED = "drain_started"
    DRAINED = "drained"
    EXIT_AFTER_DONE = "exit_after_done"
    FAULT = "fault"
    FAULT_INJECTED = "fault_injected"
    FORGED_MESSAGE = "forged_message"
    GEN_LEAVE = "gen_leave"
    GEN_PLAN = "gen_plan"
    GEN_SWITCH = "gen_switch"
    GEN_UP = "gen_up"
    IN_PLACE_UNAVAILABLE = "in_place_unavailable"
    JOINER_UNUSED = "joiner_unused"
    LEASE_LOST = "lease_lost"
    NODE_DRAINED = "node_drained"
    NODE_LOST = "node_lost"
    RECOVERY_FALLBACK = "recovery_fallback"
    RENDEZVOUS = "rendezvous"
    REPLACEMENT_STARTED = "replacement_started"
    RESTART = "restart"
    RESUME = "resume"
    SPARE_ASSIGNED = "spare_assigned"
    SPARE_LOST = "spare_lost"
    SPARE_PROMOTED = "spare_promoted"
    SPARE_READY = "spare_ready"
    SPARE_REQUEST_DECLINED = "spare_request_declined"
    SPARE_STARTED = "spare_started"
    STANDBY_READY = "standby_ready"
    STANDBYS_STARTED = "standbys_started"
    STEP = "step"
    STEP_FAILED = "step_failed"
    SWITCH_FAILED = "switch_failed"
    TRAINING_DONE = "training_done"
    WORKER_START = "worker_start"
    WORKERS_DONE = "workers_done"
    WORKERS_STARTED = "workers_started"
    WORKERS_STOPPED = "workers_stopped"
