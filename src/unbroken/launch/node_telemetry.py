"""What every agent does for its node, whatever its role: its health check before it joins
(`--health-check`), its /metrics (`--metrics-port`) and the copy of its events that
outlives its pod (`--event-dir`, `--event-stdout`). The last two read the node's events
through a `NodeLog` of their own, fed by the agent's event log."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from unbroken.errors import ExitCode, UserError
from unbroken.launch import health_check
from unbroken.launch.config import LaunchConfig
from unbroken.telemetry import schema as ev
from unbroken.telemetry.event_copy import POD_UID_ENV, EventCopy
from unbroken.telemetry.events import EVENTS_FILE, EventLog
from unbroken.telemetry.node_export import NodeExport, NodeTelemetry
from unbroken.telemetry.node_log import NodeLog


def _node_log(cfg: LaunchConfig, events: EventLog) -> NodeLog:
    log = NodeLog(Path(cfg.run_dir) / EVENTS_FILE, lambda: events.context.get("node"))
    events.observers.append(log.own)
    return log


def start_node_metrics(cfg: LaunchConfig, events: EventLog,
                       say: Callable[[str], None]) -> NodeTelemetry | None:
    """The node's /metrics (with --metrics-port), from the agent's start to its end. A port
    that cannot be bound is the user's to fix: one line, exit 2 at start."""
    if cfg.telemetry.metrics_port is None:
        return None
    addr, port = cfg.telemetry.metrics_addr, cfg.telemetry.metrics_port
    try:
        export = NodeExport(addr, port, node=cfg.node_rank or 0,
                            role="standby" if cfg.standby else "follower", run=cfg.run_id)
    except OSError as exc:
        raise UserError(f"--metrics-port {port}: cannot serve /metrics on {addr}: "
                        f"{exc.strerror or exc}; choose a free port (or --metrics-addr)"
                        ) from None
    metrics = NodeTelemetry(_node_log(cfg, events), export, say)
    host, bound = export.address
    say(f"metrics: http://{host}:{bound}/metrics")
    return metrics


def start_event_copy(cfg: LaunchConfig, events: EventLog, instance: str,
                     say: Callable[[str], None]) -> EventCopy | None:
    """The copy of the node's events (with --event-dir or --event-stdout). An event dir that
    cannot be made is the user's to fix: one line, exit 2 at start."""
    t = cfg.telemetry
    if t.event_dir is None and not t.event_stdout:
        return None
    event_dir = Path(t.event_dir) if t.event_dir is not None else None
    if event_dir is not None:
        try:
            event_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--event-dir {event_dir}: cannot make it ({exc.strerror or exc}); "
                            "give a directory on a volume every node can write") from None
    copy = EventCopy(_node_log(cfg, events), say, event_dir=event_dir,
                     ident=os.environ.get(POD_UID_ENV) or instance,
                     stdout=sys.stdout if t.event_stdout else None)
    if event_dir is not None:
        say(f"events: also in {event_dir} (this node's file: node<K>-<pod or agent id>.jsonl)")
    return copy


def check_node(cfg: LaunchConfig, events: EventLog,
               say: Callable[[str], None]) -> ExitCode | None:
    """The node's health check (`health_check`), as an event; the quarantine code and one
    line when it fails, else None."""
    h = cfg.health
    mode = health_check.HealthMode(h.health_check)
    if mode == health_check.HealthMode.OFF:
        return None
    plan = health_check.plan(mode, volume=h.check_dir, min_write_mbps=h.check_min_write,
                             memory_need=h.check_memory, gpus=h.check_gpus,
                             local_world=cfg.nproc_per_node, node_rank=cfg.node_rank or 0)
    checks = health_check.run(plan)
    why = health_check.refusal(checks)
    events.emit(ev.HealthChecked(mode=mode.value, checks=[asdict(c) for c in checks],
                                 refused=why))
    if why is None:
        return None
    say(why)
    return ExitCode.QUARANTINED
