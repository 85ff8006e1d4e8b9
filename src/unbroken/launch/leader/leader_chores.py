"""The leader's chores that decide nothing about the job: its live telemetry, the record of
agents refused at first contact, and the words of a stranded job's end."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from unbroken.control.channel import Channel
from unbroken.control.messages import NodeSet
from unbroken.control.schema import AUTH_REJECTIONS
from unbroken.errors import ExitCode
from unbroken.launch.config import LaunchConfig
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EVENTS_FILE, EventLog
from unbroken.telemetry.live import LiveTelemetry
from unbroken.telemetry.node_export import NodeTelemetry


def start_telemetry(cfg: LaunchConfig, say: Callable[[str], None],
                    metrics: NodeTelemetry | None) -> LiveTelemetry | None:
    """The job-wide series (kept for one release: the recording rules replace them) in the
    node's registry, and the status line, for as long as this agent leads."""
    if metrics is None and not cfg.telemetry.status_every:
        return None
    return LiveTelemetry(Path(cfg.run_dir) / EVENTS_FILE, say,
                         registry=metrics.export.registry if metrics is not None else None,
                         status_every=cfg.telemetry.status_every)


class Rejections:
    """Newcomers refused at first contact for another secret (`control.auth`) are the
    job's events too: at most one read a second, on an unsigned channel (a refused agent
    cannot sign)."""

    def __init__(self, channel: Channel, events: EventLog, say: Callable[[str], None]) -> None:
        self.channel = channel
        self.events = events
        self.say = say
        self._seen = 0  # AUTH_REJECTIONS entries recorded as events
        self._read = 0.0  # monotonic time of the last look at them

    def record(self) -> None:
        now = time.monotonic()
        if now - self._read < 1.0:
            return
        self._read = now
        for rejection in Channel(self.channel.backend).entries(AUTH_REJECTIONS, self._seen):
            self._seen += 1
            if rejection is None:
                continue
            self.events.emit(ev.AgentRejected(rejected_node=rejection.node,
                             host=rejection.host, reason=rejection.reason))
            self.say(f"refused an agent on {rejection.host}: {rejection.reason}")


def stranded_reason(cfg: LaunchConfig, nodes: NodeSet) -> str:
    """Why a static job whose every node is out ends (exit `QUARANTINED`)."""
    rule = cfg.recovery.quarantine
    out = ", ".join(f"node {k} {why.value}" for k, why in sorted(nodes.out.items()))
    return (f"no node is left to train on ({out}; quarantine: {rule.after} faults within "
            f"{rule.window:g}s), and no standby node can take the ranks; exit "
            f"{int(ExitCode.QUARANTINED)}: run the job on other machines, or raise "
            "--quarantine-after (0 turns quarantine off)")
