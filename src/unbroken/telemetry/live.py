"""Live telemetry on the leader's agent: the job-wide Prometheus series and the terminal
status line.

Both are fed by one reader of the run's event log (`EventTail`), so they say exactly what
the log says. The series join the node's registry (`node_export`: every agent serves one)
while this agent leads; they are kept for one release, replaced by the recording rules over
every node's counters (`metric_names`). `LiveStats` is the pure part: it folds events into counters and keeps them
for the goodput accounting (`goodput.account`), which is re-run at most every
`refresh_s`. `LiveTelemetry` is the thin executor: a thread that tails the log, updates the
Prometheus metrics (names: `telemetry.metric_names`) and prints the status line.

The leader accounts the ranks whose events it can read: all of them when the run dir is
shared (one file system), its own node's otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.telemetry import schema as ev
from unbroken.telemetry.categories import BADPUT
from unbroken.telemetry.events import parse_lines
from unbroken.telemetry.goodput import account, fault_key
from unbroken.telemetry.job_ledger import CapacityLedger
from unbroken.telemetry.metric_names import Metric

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class EventTail:
    """Reads the lines appended to an event log since the last call. Survives the log being
    rotated (a new file at the path): the old file is read to its end, then the new one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: Any = None
        self._inode: int | None = None
        self._partial = ""

    def read(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._fh is None:
            if not self.path.exists():
                return out
            self._fh = open(self.path, encoding="utf-8")  # noqa: SIM115 - kept open across reads
            self._inode = os.fstat(self._fh.fileno()).st_ino
        out += self._drain()
        try:
            rotated = os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            rotated = False
        if rotated:
            self._fh.close()
            self._fh, self._partial = None, ""
            out += self.read()
        return out

    def _drain(self) -> list[dict[str, Any]]:
        text = self._partial + self._fh.read()
        lines = text.split("\n")
        self._partial = lines.pop()  # a line still being written (no newline yet)
        return parse_lines(lines)  # a torn line from a killed writer is skipped

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


@dataclass
class LiveStats:
    """What the log has said so far, folded. `fold` is pure bookkeeping; no I/O."""

    events: list[ev.EventBody] = field(default_factory=list)  # decoded (`schema.decode`)
    step: int = 0
    step_slot: int | None = None  # the rank whose steps are counted (see `fold`)
    steps: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    spares_ready: int = 0
    world_size: int = 0
    dropped: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (t, step) for steps/s
    ledger: CapacityLedger = field(default_factory=CapacityLedger)  # resumed by a successor
    _faults_seen: set = field(default_factory=set)

    def fold(self, record: dict[str, Any] | ev.EventBody) -> list[tuple[Metric, Any]]:
        """Take one event (a record, or its decoded event); returns the observations it
        makes: (metric, value or label)."""
        e = record if isinstance(record, ev.EventBody) else ev.decode(record)
        self.events.append(e)
        obs: list[tuple[Metric, Any]] = []
        if isinstance(e, ev.WorkerStart | ev.ScriptWatched) and isinstance(e.slot, int) \
                and e.slot >= 0:
            # Steps are counted for one rank: the lowest whose worker started (rank 0 where
            # the leader can read every node's events), chosen before its first step.
            if self.step_slot is None or e.slot < self.step_slot:
                self.step_slot = e.slot
        elif isinstance(e, ev.Step) and e.source == "worker":
            if e.slot == self.step_slot:
                self.steps += 1
                self.step = max(self.step, e.step + 1)
                self.recent.append((e.t, e.step))
                obs += [(Metric.STEPS, 1), (Metric.STEP_TIME, e.duration)]
        elif isinstance(e, ev.ScriptSteps) and e.slot == self.step_slot:
            for step, began, ended, *_ in e.steps:  # an unchanged script's, by the hooks
                self.steps += 1
                self.step = max(self.step, int(step))
                self.recent.append((e.t, self.steps))
                obs += [(Metric.STEPS, 1), (Metric.STEP_TIME, ended - began)]
        elif isinstance(e, ev.Fault):
            # A death taken in place, then charged to a restart, is logged twice: count once.
            key = fault_key(e)
            if key in self._faults_seen:
                return obs
            self._faults_seen.add(key)
            kind = str(e.kind)
            self.faults[kind] = self.faults.get(kind, 0) + 1
            obs.append((Metric.FAULTS, kind))
        elif isinstance(e, ev.AnomalyClassified | ev.SdcMismatch | ev.StragglerFlagged):
            kind = e.kind if isinstance(e, ev.AnomalyClassified) else (
                "sdc" if isinstance(e, ev.SdcMismatch) else "straggler")
            if not (isinstance(e, ev.SdcMismatch) and e.resolution == "recompute"):
                obs.append((Metric.ANOMALIES, kind))  # a dispute settled is not a second
        elif isinstance(e, ev.Restart):
            self.restarts += 1
            obs.append((Metric.RESTARTS, 1))
        elif isinstance(e, ev.GenUp):
            self.ledger.fold(e)
            if e.world_size is not None:
                self.world_size = e.world_size
            if e.duration is not None and e.faults:
                obs.append((Metric.RECOVERY_TIME, e.duration))
        elif isinstance(e, ev.Rendezvous):
            self.ledger.fold(e)
            if e.world_size is not None:
                self.world_size = e.world_size
        elif isinstance(e, ev.CheckpointSaved | ev.CheckpointFailed) \
                and e.slot == (self.step_slot or 0):
            if e.stall is not None:
                obs.append((Metric.CHECKPOINT_STALL, e.stall))
            if isinstance(e, ev.CheckpointSaved) and e.durable is not None:
                obs.append((Metric.CHECKPOINT_DURABLE, e.durable))
        elif isinstance(e, ev.SpareReady) and e.source == "worker":
            self.spares_ready += 1
        elif isinstance(e, ev.SparePromoted | ev.SpareLost) and e.source == "agent":
            self.spares_ready = max(0, self.spares_ready - 1)
        elif isinstance(e, ev.EventsDropped):
            self.dropped += int(e.dropped or 0)
            obs.append((Metric.EVENTS_DROPPED, int(e.dropped or 0)))
        return obs

    def steps_per_s(self, window: float = 30.0) -> float | None:
        if len(self.recent) < 2:
            return None
        t_last, s_last = self.recent[-1]
        first = next(((t, s) for t, s in self.recent if t >= t_last - window), self.recent[0])
        dt = t_last - first[0]
        return (s_last - first[1]) / dt if dt > 0 and s_last > first[1] else None

    def goodput(self) -> dict[str, Any] | None:
        """The accounting of everything so far (None before any event)."""
        if not self.events:
            return None
        seen = sorted({e.slot for e in self.events if e.source == "worker"
                       and isinstance(e.slot, int) and e.slot >= 0})
        return account(sorted(self.events, key=lambda e: e.t or 0.0),
                       slots=seen or None, until=time.time())


class SayOnce:
    """Says a telemetry thread's error in one line, once while it persists: `what` prefixes
    it, `cost` ends it ("... (metrics may be stale)"). Telemetry never stops the job."""

    def __init__(self, say: Callable[[str], None], what: str, cost: str) -> None:
        self._say, self._what, self._cost = say, what, cost
        self._last: str | None = None

    def __call__(self, exc: Exception) -> None:
        why = f"{type(exc).__name__}: {exc}"
        if why != self._last:
            self._say(f"{self._what}: {why} ({self._cost})")
        self._last = why


def status_line(stats: LiveStats, report: dict[str, Any] | None) -> str:
    """One line for the terminal: step, steps/s, goodput so far, faults, spares ready."""
    rate = stats.steps_per_s()
    good = report.get("goodput") if report else None
    return (f"status: step {stats.step}"
            + (f", {rate:.1f} steps/s" if rate is not None else "")
            + (f", goodput {100 * good:.0f}% so far" if good is not None else "")
            + f", faults {sum(stats.faults.values())}"
            + f", spares ready {stats.spares_ready}")


class PrometheusExport:
    """The job-wide series, registered in the node's registry until `close`."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        r = self.registry = registry
        self.goodput = Gauge(Metric.GOODPUT, "Productive step time over wall time x ranks",
                             registry=r)
        self.badput = Gauge(Metric.BADPUT, "Seconds per rank by badput category",
                            ["category"], registry=r)
        self.wall = Gauge(Metric.WALL, "Seconds since the job started", registry=r)
        self.step = Gauge(Metric.STEP, "The newest committed step", registry=r)
        self.world = Gauge(Metric.WORLD_SIZE, "Ranks in the running generation", registry=r)
        self.spares = Gauge(Metric.SPARES_READY, "Hot spares warmed up, not promoted", registry=r)
        self.counters = {
            Metric.STEPS: Counter(Metric.STEPS, "Step computations", registry=r),
            Metric.RESTARTS: Counter(Metric.RESTARTS, "Full restarts", registry=r),
            Metric.EVENTS_DROPPED: Counter(Metric.EVENTS_DROPPED, "Events not stored",
                                           registry=r),
        }
        self.faults = Counter(Metric.FAULTS, "Faults by kind", ["kind"], registry=r)
        self.anomalies = Counter(Metric.ANOMALIES, "Anomalies found, by kind", ["kind"],
                                 registry=r)
        self.histograms = {
            Metric.STEP_TIME: Histogram(Metric.STEP_TIME, "Step durations",
                                        buckets=STEP_BUCKETS, registry=r),
            Metric.RECOVERY_TIME: Histogram(Metric.RECOVERY_TIME, "In-place recoveries",
                                            buckets=RECOVERY_BUCKETS, registry=r),
            Metric.CHECKPOINT_STALL: Histogram(Metric.CHECKPOINT_STALL, "Checkpoint stall",
                                               buckets=STEP_BUCKETS, registry=r),
            Metric.CHECKPOINT_DURABLE: Histogram(Metric.CHECKPOINT_DURABLE,
                                                 "Checkpoint start to commit",
                                                 buckets=RECOVERY_BUCKETS, registry=r),
        }
        self.ledger: CapacityLedger | None = None  # set by `set`; read at each scrape
        self._collectors = [self.goodput, self.badput, self.wall, self.step, self.world,
                            self.spares, self.faults, self.anomalies,
                            *self.counters.values(), *self.histograms.values(),
                            _LedgerCollector(self)]
        r.register(self._collectors[-1])

    def observe(self, obs: list[tuple[Metric, Any]]) -> None:
        for metric, value in obs:
            if metric == Metric.FAULTS:
                self.faults.labels(kind=value).inc()
            elif metric == Metric.ANOMALIES:
                self.anomalies.labels(kind=value).inc()
            elif metric in self.counters:
                self.counters[metric].inc(value)
            else:
                self.histograms[metric].observe(value)

    def set(self, stats: LiveStats, report: dict[str, Any] | None) -> None:
        self.ledger = stats.ledger
        self.step.set(stats.step)
        self.world.set(stats.world_size)
        self.spares.set(stats.spares_ready)
        if report is not None:
            self.wall.set(report["wall_s"])
            if report["goodput"] is not None:
                self.goodput.set(report["goodput"])
            for c in BADPUT:
                self.badput.labels(category=c.value).set(report["badput_s"][c.value])

    def close(self) -> None:
        """Leave the registry (the agent no longer leads)."""
        for collector in self._collectors:
            self.registry.unregister(collector)


class _LedgerCollector:
    """The leader's counter of capacity lost and its generation gauge, read from the ledger
    at each scrape (the capacity grows with time, between events too)."""

    def __init__(self, export: PrometheusExport) -> None:
        self._export = export

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ledger = self._export.ledger
        if ledger is None:
            return
        yield CounterMetricFamily(Metric.JOB_CAPACITY_LOST, "Rank-seconds run short of ranks",
                                  value=ledger.total(time.time()))
        yield GaugeMetricFamily(Metric.JOB_GENERATION, "The newest generation up",
                                value=ledger.gen)


class LiveTelemetry:
    """The leader's thread: every `poll_s` it reads the log's new events into `LiveStats` and
    the metrics; every `refresh_s` (without metrics: every `status_every`) it re-runs the
    accounting; every `status_every` it says the status line (0: never). `close()` stops it
    and takes its series out of the registry."""

    def __init__(self, events_path: Path, say: Callable[[str], None], *,
                 registry: Any = None, status_every: float,
                 refresh_s: float = 5.0, poll_s: float = 0.5) -> None:
        self.stats = LiveStats()
        self._tail = EventTail(events_path)
        self._say = say
        self._status_every = status_every
        self._refresh_s = refresh_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self.export = PrometheusExport(registry) if registry is not None else None
        self.report: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._loop, name="unbroken-telemetry",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # Without a scraper to serve, the accounting runs only as often as the status line.
        refresh_every = self._refresh_s if self.export is not None else self._status_every
        refreshed = said = time.monotonic()
        failed = SayOnce(self._say, "telemetry", "metrics and status may be stale")
        while not self._stop.wait(self._poll_s):
            now = time.monotonic()
            due = now - refreshed >= refresh_every
            try:
                self.tick(refresh=due)
            except Exception as exc:  # noqa: BLE001 -- telemetry must never stop the job
                failed(exc)
            if due:
                refreshed = now
            if self._status_every and now - said >= self._status_every:
                said = now
                self._say(status_line(self.stats, self.report))

    def tick(self, refresh: bool = True) -> None:
        for e in self._tail.read():
            obs = self.stats.fold(e)
            if self.export is not None:
                self.export.observe(obs)
        if refresh:
            self.report = self.stats.goodput()
        if self.export is not None:
            self.export.set(self.stats, self.report)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._tail.close()
        if self.export is not None:
            self.export.close()
