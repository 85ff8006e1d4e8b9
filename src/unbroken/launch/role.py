"""What both agent roles (`leader.Leader`, `follower.Follower`) are given."""

from __future__ import annotations

from collections.abc import Callable

from unbroken.control.channel import Channel
from unbroken.control.messages import Fault
from unbroken.launch.attempt import AttemptWatch
from unbroken.launch.config import LaunchConfig
from unbroken.launch.election import Election
from unbroken.telemetry.events import EventLog
from unbroken.telemetry.node_export import NodeTelemetry


class Role:
    """An agent's role: `run()` returns the exit code; `interrupted(signum)` tells the others."""

    def __init__(self, cfg: LaunchConfig, channel: Channel, watch: AttemptWatch,
                 events: EventLog, instance: str, sleep: Callable[[], None],
                 report_failure: Callable[[Fault | None, str | None], None],
                 election: Election | None = None, metrics: NodeTelemetry | None = None) -> None:
        self.cfg = cfg
        self.channel = channel
        self.watch = watch  # this node's processes, attempt by attempt
        self.events = events
        self.instance = instance  # this agent's id: a restarted agent is a new instance
        self._sleep = sleep  # a short sleep that raises on SIGINT/SIGTERM
        self._report_failure = report_failure
        self.election = election  # None: leadership is fixed on node 0 (TCPStore)
        self.metrics = metrics  # the node's /metrics (--metrics-port), or None
        self.outage_ended = False  # set by the agent when the control plane answers again

    def say(self, msg: str) -> None:
        self.watch.say(msg)

    def run(self) -> int:
        raise NotImplementedError

    def interrupted(self, signum: int, held_ranks: bool = True) -> None:
        """This agent stops on a signal; `held_ranks`: its node ran workers of the job."""
        raise NotImplementedError

    def hand_off(self) -> bool:
        """SIGTERM as a notice: ask for this node's ranks to move to ready spares or a
        standby node, after which the role returns as a drained node does. False when that
        cannot be asked (here, or not now): the agent then stops as for any signal."""
        return False

    def hand_off_pending(self) -> bool:
        """After `hand_off`: True until the leader has refused it."""
        return False
