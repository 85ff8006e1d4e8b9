"""Every agent's `/metrics`: its node's counters (`node_metrics`), served by prometheus_client.

`NodeTelemetry` is the executor: the HTTP server (bound once, at the agent's start, whatever
its role, so that every target a ServiceMonitor selects answers), a registry the leader's
job-wide series join while it leads (`live.LiveTelemetry`), and a thread that every
`poll_s` folds the node's new events (`node_log.NodeLog`: the agent's own and its
workers'), and every `refresh_s` advances the
rank-seconds from the goodput accounting of what the node's log holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from unbroken.telemetry import schema as ev
from unbroken.telemetry.categories import Category
from unbroken.telemetry.goodput import account
from unbroken.telemetry.live import SayOnce
from unbroken.telemetry.metric_names import NODE_LABEL, Metric
from unbroken.telemetry.node_log import NodeLog
from unbroken.telemetry.node_metrics import (
    FAULT_KINDS,
    RECOVERY_KINDS,
    NodeCounters,
    Observation,
    RankSeconds,
    settled_until,
    tenancy_seconds,
)

SWITCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class NodeExport:
    """The node's series in a registry of their own, and the HTTP server that serves it."""

    def __init__(self, addr: str, port: int, node: int, role: str, run: str) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            start_http_server,
        )

        r = self.registry = CollectorRegistry()
        lbl = [NODE_LABEL]
        self.info = Gauge(Metric.NODE_INFO, "The agent is up", [*lbl, "role", "run"], registry=r)
        self.start = Gauge(Metric.NODE_START, "When the agent started", lbl, registry=r)
        self.rank_seconds = Counter(Metric.NODE_RANK_SECONDS, "Rank-seconds by category",
                                    [*lbl, "category"], registry=r)
        self.steps = Counter(Metric.NODE_STEPS, "Step computations", lbl, registry=r)
        self.faults = Counter(Metric.NODE_FAULTS, "Faults by kind", [*lbl, "kind"], registry=r)
        self.recoveries = Counter(Metric.NODE_RECOVERIES, "Recoveries by kind", [*lbl, "kind"],
                                  registry=r)
        self.switch = Histogram(Metric.NODE_SWITCH_TIME, "Workers' switches", lbl,
                                buckets=SWITCH_BUCKETS, registry=r)
        self.stall = Counter(Metric.NODE_CHECKPOINT_STALL, "Checkpoint stall", lbl, registry=r)
        self.node, self._role, self._run, self._started = "", role, run, time.time()
        self.set_node(node)
        self.server, self.thread = start_http_server(port, addr=addr, registry=r)

    def set_node(self, node: int) -> None:
        """Label every series with `node` (an agent given its node rank after it started:
        none of its series has counted anything yet)."""
        for metric in (self.info, self.start, self.rank_seconds, self.steps, self.faults,
                       self.recoveries, self.switch, self.stall):
            metric.clear()
        self.node = str(node)
        self.set_role(self._role)
        self.start.labels(self.node).set(self._started)
        # Every label value a rule may take an increase of exists from the start, at 0: a
        # series that first appears at 1 has no earlier sample, and increase() misses it.
        for c in Category:
            self.rank_seconds.labels(self.node, c.value)
        for kind in FAULT_KINDS:
            self.faults.labels(self.node, kind)
        for kind in RECOVERY_KINDS:
            self.recoveries.labels(self.node, kind)
        self.steps.labels(self.node)
        self.stall.labels(self.node)
        self.switch.labels(self.node)

    def set_role(self, role: str) -> None:
        """The agent's role now (`leader`, `follower`, `standby`): one `info` series."""
        self.info.clear()
        self.info.labels(self.node, role, self._run).set(1)
        self._role = role

    def observe(self, obs: list[Observation]) -> None:
        for metric, label, amount in obs:
            if metric == Metric.NODE_RANK_SECONDS:
                self.rank_seconds.labels(self.node, label).inc(amount)
            elif metric == Metric.NODE_STEPS:
                self.steps.labels(self.node).inc(amount)
            elif metric == Metric.NODE_FAULTS:
                self.faults.labels(self.node, label).inc(amount)
            elif metric == Metric.NODE_RECOVERIES:
                self.recoveries.labels(self.node, label).inc(amount)
            elif metric == Metric.NODE_SWITCH_TIME:
                self.switch.labels(self.node).observe(amount)
            elif metric == Metric.NODE_CHECKPOINT_STALL:
                self.stall.labels(self.node).inc(amount)

    @property
    def address(self) -> tuple[str, int]:
        return self.server.server_address[:2]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class NodeTelemetry:
    """The agent's thread behind its node's series. `own(record)` hands it each event the
    agent emits (from any thread); `close()` folds what is left, counts the rank-seconds to
    the end, and stops the server."""

    def __init__(self, log: NodeLog, export: NodeExport, say: Callable[[str], None], *,
                 refresh_s: float = 5.0, poll_s: float = 0.5) -> None:
        self.export = export
        self._log = log
        self._say = say
        self._events: list[ev.EventBody] = []  # this node's, for the accounting
        self._counters: NodeCounters | None = None
        self._seconds = RankSeconds()
        self._refresh_s, self._poll_s = refresh_s, poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one fold at a time: the thread's, or close()'s
        self._thread = threading.Thread(target=self._loop, name="unbroken-node-metrics",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        refreshed = time.monotonic()
        failed = SayOnce(self._say, "metrics", "the node's series may be stale")
        while not self._stop.wait(self._poll_s):
            due = time.monotonic() - refreshed >= self._refresh_s
            try:
                self.tick(refresh=due)
            except Exception as exc:  # noqa: BLE001 -- metrics must never stop the job
                failed(exc)
            if due:
                refreshed = time.monotonic()

    def tick(self, refresh: bool = True, until: float | None = None) -> None:
        """Fold what is new; with `refresh`, advance the rank-seconds (to `until`, else to
        the settled present)."""
        with self._lock:
            node = self._log.node()
            if node is None:  # not yet given a node rank: nothing is this node's yet
                return
            if self._counters is None or self._counters.node != node:
                self._counters = NodeCounters(node)
                if self.export.node != str(node):
                    self.export.set_node(node)
            counters, obs = self._counters, []
            for own, record in self._log.read():
                e = ev.decode(record)
                self._events.append(e)
                obs += counters.fold_own(e) if own else counters.fold_worker(e)
            if refresh and counters.slots and self._events:
                obs += self._advance(counters, until)
            self.export.observe(obs)

    def _advance(self, counters: NodeCounters, until: float | None) -> list[Observation]:
        events = sorted(self._events, key=lambda e: e.t or 0.0)
        end = until if until is not None else settled_until(time.time(), counters)
        report = account(events, slots=sorted(counters.slots), until=end)
        return self._seconds.advance(tenancy_seconds(report["timeline"], counters.slots, end))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            self.tick(refresh=True, until=time.time())
        except Exception as exc:  # noqa: BLE001
            self._say(f"metrics: {type(exc).__name__}: {exc} (the last counts are lost)")
        self._log.close()
        self.export.close()
