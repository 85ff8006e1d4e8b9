"""What a simulation is told: the job, its failures, and what each recovery costs at scale.

Declared once, as typed dataclasses with a docstring per field; the command line
(`simulate/cli.py`) only fills them in. Every default is sourced: this project's own
benchmarks (benchmarks/README.md) for what we measured, the published figures in
`Published` for what we cannot measure on 2 CPU cores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from unbroken.errors import UserError


class Kind(StrEnum):
    """What failed. Each kind is handled differently by each strategy (`engine._outcome`)."""

    CRASH = "crash"
    """One GPU's worker is lost and its GPU is out until its node is repaired (GPU, HBM,
    SRAM faults and software bugs: 75 % of Llama 3's unexpected interruptions)."""
    HANG = "hang"
    """A worker stops making progress while alive (NCCL watchdog timeouts); its GPU is fine."""
    NODE_LOST = "node_lost"
    """A whole host leaves: network, host, power (20 % of Llama 3's)."""
    STRAGGLER = "straggler"
    """A GPU runs slow for a while and holds the job to its pace; nothing crashes."""
    SDC = "sdc"
    """Silent data corruption on one GPU: wrong numbers, no error."""


class CheckpointMode(StrEnum):
    """How the job checkpoints today (`--checkpoint`)."""

    SYNC = "sync"
    """The loop stops for the whole save (`torch.save` on the training thread): the
    restart-style arm ("what you have today") is given it; unbroken's arms save
    asynchronously, at Young/Daly's cadence for their stall."""
    ASYNC = "async"
    """The loop stops only for a copy to host memory: every arm saves so (as without the flag)."""


class Strategy(StrEnum):
    """How the job recovers, compared on the same failure draws."""

    TORCHRUN = "torchrun"
    """Every worker restarts and reloads the last durable checkpoint."""
    IN_PLACE = "in_place"
    """unbroken: survivors keep their processes and state; the job shrinks until the lost
    capacity comes back; no spares."""
    SPARES = "spares"
    """unbroken with spare GPUs on each node that take a lost rank in place."""
    SPARES_STANDBY = "spares_standby"
    """unbroken with spares and standby nodes that take a lost node's ranks in place."""


DEFAULT_SHARES: Mapping[Kind, float] = MappingProxyType({
    Kind.CRASH: 0.75, Kind.NODE_LOST: 0.20, Kind.HANG: 0.02, Kind.SDC: 0.01,
    Kind.STRAGGLER: 0.02})
"""From Llama 3's 419 unexpected interruptions (section 3.3.4): GPU faults (58.7 %) and
software bugs as crashes, network and host faults as lost nodes, NCCL watchdog timeouts as
hangs, its 6 SDCs; stragglers are not interruptions there, 2 % is our assumption."""


@dataclass(frozen=True)
class Published:
    """The published figures the model is anchored on and checked against (docs/simulate.md
    gives the sources)."""

    rsc_mttf_hours: Mapping[int, float] = field(default_factory=lambda: MappingProxyType(
        {8: 47.7 * 24, 1024: 7.9, 16384: 1.8}))
    """Meta RSC (Kokolis et al., HPCA'25): job MTTF at 8, 1,024 and 16,384 GPUs."""
    rsc_node_rate_per_day: float = 6.5e-3
    """RSC-1's failures per node-day, the rate behind its 1.8 h at 16,384 GPUs."""
    restart_s: Mapping[int, float] = field(default_factory=lambda: MappingProxyType(
        {32: 80.0, 1024: 300.0, 8192: 388.0}))
    """A full restart at each scale: TrainMover's Megatron-LM restarts (32 and 1,024 GPUs,
    without rescheduling) and a production restart at 8,192 GPUs (6.47 min)."""
    in_place_s: Mapping[int, float] = field(default_factory=lambda: MappingProxyType(
        {32: 19.6, 1024: 21.1}))
    """TrainMover's downtime per unexpected failure, a recovery that keeps the job: the
    anchor of communicator set-up at scale."""
    llama3_days: float = 54.0
    llama3_gpus: int = 16384
    llama3_unexpected: int = 419
    llama3_planned: int = 47
    llama3_ettr: float = 0.90
    """Llama 3: "higher than 90 % effective training time" (a lower bound)."""


PUBLISHED = Published()


@dataclass(frozen=True)
class Measured:
    """This project's own recovery costs, measured on 4 CPU workers (benchmarks/README.md)."""

    workers: int = 4
    """The scale these were measured at."""
    switch_s: float = 0.276
    """In place, kill to the first resumed step (recovery.py, e11ffbb)."""
    spare_s: float = 0.182
    """A hot spare promoted into the lost rank (spares.py, e11ffbb)."""
    crash_detect_s: float = 0.05
    """A dead worker seen by its agent (restart.py: 0.02-0.05 s)."""
    hang_detect_s: float = 1.207
    """A stopped worker to the first resumed step, 1.0 s of it the hang timeout (hang.py)."""
    node_detect_s: float = 5.0
    """A lost node: its lease lapses, `--node-timeout` (pods.py: 4.8-5.0 s)."""
    checkpoint_stall_s: float = 0.0007
    """The loop's stall for an async checkpoint (checkpoint.py, 515 MB of state)."""
    checkpoint_durable_s: float = 0.719
    """From the stall to the checkpoint durable on disk (checkpoint.py)."""
    full_restart_s: float = 7.44
    """A full restart of 4 workers from the last checkpoint (recovery.py's torchrun arm)."""
    straggler_detect_steps: int = 20
    """Steps from a 1.5x straggler's start to its flag (anomalies.py)."""
    sdc_every_steps: int = 100
    """The replica checks' cap on K (anomalies.py measured K = 39 and a flip found in 36)."""


MEASURED = Measured()


@dataclass(frozen=True)
class Failures:
    """When and how the job fails."""

    job_mttf_hours: float | None = 1.8
    """The job's mean time to failure at `mttf_gpus` GPUs (default: Meta RSC's 1.8 h at
    16,384); the rate per GPU is taken as constant, so at N GPUs it is this x mttf_gpus / N."""
    mttf_gpus: int = 16384
    """The scale `job_mttf_hours` was observed at."""
    gpu_mtbf_hours: float | None = None
    """Instead: one GPU's mean time between failures (the job's is this / N)."""
    shares: Mapping[Kind, float] = field(default_factory=lambda: DEFAULT_SHARES)
    """Each kind's share of the failures; they sum to 1."""
    weibull_shape: float = 1.0
    """Shape of the times between failures: 1 is exponential (a Poisson process), below 1
    failures cluster, above 1 they come more evenly; the mean stays the MTTF."""

    def __post_init__(self) -> None:
        for name in ("job_mttf_hours", "gpu_mtbf_hours"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UserError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.mttf_gpus <= 0:
            raise UserError("--mttf-gpus must be positive")
        if not 0.1 <= self.weibull_shape <= 20:
            raise UserError(f"--weibull-shape must be between 0.1 and 20, got "
                            f"{self.weibull_shape:g}")
        if any(not math.isfinite(v) or v < 0 for v in self.shares.values()):
            raise UserError(f"failure shares must not be negative: {dict(self.shares)}")
        total = sum(self.shares.values())
        if abs(total - 1.0) > 1e-6:
            raise UserError(f"failure shares must sum to 1, they sum to {total:g}: "
                            f"{', '.join(f'{k}={v:g}' for k, v in self.shares.items())}")

    def job_mttf_s(self, gpus: int) -> float:
        """The job's mean time to failure at `gpus` GPUs, in seconds."""
        if self.gpu_mtbf_hours is not None:
            return self.gpu_mtbf_hours * 3600.0 / gpus
        assert self.job_mttf_hours is not None
        return self.job_mttf_hours * 3600.0 * self.mttf_gpus / gpus


@dataclass(frozen=True)
class Job:
    """The job and the capacity it holds in reserve."""

    gpus: int = 16384
    """GPUs that train."""
    gpus_per_node: int = 8
    days: float = 54.0
    """Wall time simulated."""
    step_s: float = 5.0
    """One training step (lost in flight by an in-place recovery; sets detection windows)."""
    replica_gpus: int = 8
    """GPUs of one data-parallel replica (its tensor and pipeline groups): what the job
    loses while it runs shrunk after losing one GPU."""
    checkpoint_every_s: float | None = None
    """Compute between checkpoints; None: Young/Daly for the checkpoint's stall and the MTTF."""
    checkpoint: CheckpointMode | None = None
    """How the job checkpoints today (`--checkpoint`); None: asynchronously, every arm alike
    (the model before the flag)."""
    checkpoint_stall_s: float | None = None
    """What one save of today's stops the loop (`--checkpoint-stall`); None: the model's (a
    synchronous save writes the node's state to storage; an asynchronous one copies a GPU's
    state to host memory)."""
    spares_per_node: int = 1
    """Spare GPUs per node (strategies `spares` and `spares_standby`), within
    `gpus_per_node`: a node of 8 GPUs with 1 spare trains on 7, so the job holds more nodes
    (`spare_nodes`). ETTR stays a ratio over the training GPUs."""
    standby_nodes: int = 2
    """Standby nodes (strategy `spares_standby`)."""
    node_replace_s: float = 30 * 60.0
    """Time for the scheduler to give back a lost node (replacement and warm-up)."""
    worker_start_s: float = 60.0
    """A new worker process on a healthy GPU, to its joining (imports, CUDA, communicators)."""
    restart_s: float | None = None
    """One torchrun-style restart, failure to training again; None: `Scale.restart_s`."""
    switch_s: float | None = None
    """The in-place switch's whole downtime at this scale, communicator set-up included
    (`--switch-s`, or the switch a `--from-run` measured); None: `Scale.switch_s`'s model."""
    torchrun_hang_s: float = 600.0
    """How long torchrun's survivors wait in a hung collective: NCCL's default timeout."""
    straggler_s: float = 3600.0
    """How long a straggler lasts when nobody drains it."""
    straggler_factor: float = 1.5
    """How much slower a straggler's steps are."""
    sdc_found_after_s: float = 3600.0
    """Without replica checks, how long until a corruption shows (a loss spike, a person)."""
    state_gb_per_gpu: float = 2.0
    """Model and optimizer state per GPU (Llama 3: 1 MB to 4 GB per GPU)."""
    host_copy_gbps: float = 25.0
    """GB/s from a GPU to host memory: the checkpoint's stall and a spare's state transfer."""
    storage_gbps_per_node: float = 5.0
    """GB/s from one node to durable storage: how long a checkpoint takes to persist."""

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "days", "step_s", "replica_gpus",
                     "node_replace_s", "worker_start_s", "straggler_factor", "state_gb_per_gpu",
                     "host_copy_gbps", "storage_gbps_per_node"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name.replace('_', ' ')} must be positive, got "
                                f"{getattr(self, name)}")
        if self.switch_s is not None and not self.switch_s >= 0:
            raise UserError(f"--switch-s must not be negative, got {self.switch_s:g}")
        if self.checkpoint_stall_s is not None and not self.checkpoint_stall_s > 0:
            raise UserError(f"--checkpoint-stall must be positive, got {self.checkpoint_stall_s:g}")
        if self.spares_per_node >= self.gpus_per_node:
            raise UserError(f"--spares {self.spares_per_node} leaves no GPU of a "
                            f"{self.gpus_per_node}-GPU node to train: spares are counted "
                            f"within --gpus-per-node")
        for name in ("spares_per_node", "standby_nodes"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-').replace('-per-node', '')} must not "
                                f"be negative")
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise UserError(f"--gpus {self.gpus} is not a whole number of nodes of "
                            f"--gpus-per-node {self.gpus_per_node}")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def spare_nodes(self) -> int:
        """Nodes the job holds when each keeps `spares_per_node` of its GPUs spare."""
        return max(1, math.ceil(self.gpus / (self.gpus_per_node - self.spares_per_node)))

    def reserved_gpus(self, strategy: Strategy) -> int:
        """GPUs paid for that do not train: spares on every node, standby nodes."""
        reserved = 0
        if strategy in (Strategy.SPARES, Strategy.SPARES_STANDBY):
            reserved += self.spare_nodes * self.gpus_per_node - self.gpus
        if strategy == Strategy.SPARES_STANDBY:
            reserved += self.standby_nodes * self.gpus_per_node
        return reserved

    @property
    def horizon_s(self) -> float:
        return self.days * 86400.0


def power_fit(points: Mapping[int, float]) -> tuple[float, float]:
    """(a, b) of cost = a x N^b, least squares in log space."""
    xs = [math.log(n) for n in points]
    ys = [math.log(v) for v in points.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / \
        sum((x - mx) ** 2 for x in xs)
    return math.exp(my - b * mx), b


def log_fit(points: Mapping[int, float]) -> tuple[float, float]:
    """(a, b) of cost = a + b x log2(N), through the points' least squares."""
    xs = [math.log2(n) for n in points]
    ys = list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / \
        sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


@dataclass(frozen=True)
class Scale:
    """How each cost grows from the 4 workers we measured to N GPUs (docs/simulate.md):

    - a switch in place pays our measured switch plus communicator set-up at N, which grows
      with log N (TrainMover's in-place downtimes at 32 and 1,024 GPUs);
    - a spare or a standby node adds the lost ranks' state over the network;
    - a full restart grows as a power of N (TrainMover's and a production restart's
      figures at 32, 1,024 and 8,192 GPUs), unless the user gives `--restart-min`;
    - a checkpoint stalls for the state's copy to host memory and persists at the node's
      storage bandwidth; detection times do not grow (leases and timeouts).

    `factor` multiplies one named cost, for the sensitivity table."""

    measured: Measured = MEASURED
    published: Published = PUBLISHED
    factor: Mapping[str, float] = field(default_factory=dict)

    def _x(self, name: str, value: float) -> float:
        return value * self.factor.get(name, 1.0)

    def comm_setup_s(self, gpus: int) -> float:
        a, b = log_fit(self.published.in_place_s)
        return max(0.0, a + b * math.log2(max(gpus, 1)))

    def switch_s(self, job: Job) -> float:
        """The survivors' switch to a new generation, in place: the job's own figure where
        it has one (`Job.switch_s`), else our measured switch plus communicator set-up at N."""
        if job.switch_s is not None:
            return self._x("switch", job.switch_s)
        return self._x("switch", self.measured.switch_s + self.comm_setup_s(job.gpus))

    def spare_s(self, job: Job) -> float:
        """A spare (or a standby node's spares) taking ranks in place, state included: a
        switch (the job's own figure where it has one) and the lost ranks' state."""
        transfer = job.state_gb_per_gpu / job.host_copy_gbps
        if job.switch_s is not None:
            return self._x("spare", job.switch_s + transfer)
        return self._x("spare", self.measured.spare_s + self.comm_setup_s(job.gpus) + transfer)

    def restart_s(self, job: Job) -> float:
        if job.restart_s is not None:
            return self._x("restart", job.restart_s)
        a, b = power_fit(self.published.restart_s)
        return self._x("restart", max(self.measured.full_restart_s, a * job.gpus ** b))

    def detect_s(self, kind: Kind, job: Job) -> float:
        """unbroken's time to see a failure of this kind (hangs: 3 x the step, floor 1 s)."""
        if kind == Kind.HANG:
            timeout = max(1.0, 3.0 * job.step_s)
            value = self.measured.hang_detect_s - 1.0 + timeout
        elif kind == Kind.NODE_LOST:
            value = self.measured.node_detect_s
        else:
            value = self.measured.crash_detect_s
        return self._x("detect", value)

    def checkpoint_stall_s(self, job: Job) -> float:
        return self._x("checkpoint", max(self.measured.checkpoint_stall_s,
                                         job.state_gb_per_gpu / job.host_copy_gbps))

    def checkpoint_persist_s(self, job: Job) -> float:
        return self._x("checkpoint", max(
            self.measured.checkpoint_durable_s,
            job.state_gb_per_gpu * job.gpus_per_node / job.storage_gbps_per_node))

    def node_replace_s(self, job: Job) -> float:
        return self._x("node_replace", job.node_replace_s)


SENSITIVE = ("switch", "spare", "restart", "detect", "checkpoint", "node_replace")
"""The costs the sensitivity table varies (`Scale.factor`)."""
