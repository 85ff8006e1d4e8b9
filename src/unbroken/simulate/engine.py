"""The simulation: one job's wall time, charged to the goodput categories, per seed.

Pure and vectorised: every array holds one value per seed, and the loop walks the failures
in time order (column j of `Draws` is each seed's j-th failure). Between failures the job
computes, stalling for a checkpoint every `Checkpoints.every_s` of compute. At a failure
the strategy's outcome (`_outcome`) decides what the job pays:

- `infrastructure_recovery`: downtime, detection included; a failure during a recovery
  starts it again (the unfinished part is refunded);
- `wasted_progress`: computed work lost (back to the last durable checkpoint, or the step
  in flight when survivors keep their state);
- `capacity_lost`: the share of the job missing while it runs shrunk, for as long;
- `straggler`: the time a slow GPU holds every step back;
- `checkpoint_save`: the loop's stalls.

Every seed's categories sum to its wall time (`Outcome.check`). Simplifications, stated in
docs/simulate.md: a shrink window and the grow switch that ends it are charged in full
even where a later failure overlaps them; a spare GPU, once used, stays used until its node
is replaced; detection and recovery of one failure never overlap another's but restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from unbroken.checkpoint.interval import daly_interval
from unbroken.simulate.draws import KINDS, Draws
from unbroken.simulate.inputs import Failures, Job, Kind, Scale, Strategy
from unbroken.telemetry.categories import Category

CHARGED = (Category.PRODUCTIVE_STEP, Category.CHECKPOINT_SAVE, Category.WASTED_PROGRESS,
           Category.INFRASTRUCTURE_RECOVERY, Category.CAPACITY_LOST, Category.STRAGGLER)
"""The categories a simulated job's time goes to (the others do not arise here)."""

_K = {kind: i for i, kind in enumerate(KINDS)}


@dataclass(frozen=True)
class Checkpoints:
    """The checkpoint cadence: `stall_s` of the loop every `every_s` of compute, durable
    `persist_s` after the stall."""

    every_s: float
    stall_s: float
    persist_s: float

    @classmethod
    def for_job(cls, job: Job, scale: Scale, failures: Failures) -> Checkpoints:
        """The job's cadence: `job.checkpoint_every_s`, else Young/Daly (Daly's form, as the
        checkpointer computes it) for the stall and the job's MTTF, never below the time a
        checkpoint takes to persist."""
        stall, persist = scale.checkpoint_stall_s(job), scale.checkpoint_persist_s(job)
        every = job.checkpoint_every_s
        if every is None:
            every = max(daly_interval(stall, failures.job_mttf_s(job.gpus)), persist)
        return cls(every_s=every, stall_s=stall, persist_s=persist)


@dataclass(frozen=True)
class Outcome:
    """Seconds per category, one value per seed, and the failures each seed met."""

    seconds: dict[Category, np.ndarray]
    failures: np.ndarray
    horizon_s: float

    @property
    def ettr(self) -> np.ndarray:
        """Effective training time ratio per seed: productive time over wall time."""
        return self.seconds[Category.PRODUCTIVE_STEP] / self.horizon_s

    def check(self) -> None:
        """Every seed's categories sum to its wall time, and none is negative."""
        total = sum(self.seconds.values())
        assert np.allclose(total, self.horizon_s, rtol=1e-9, atol=1e-6), total
        for c, v in self.seconds.items():
            assert (v >= -1e-6).all(), (c, v.min())


def _segment(avail, phase, ck: Checkpoints):
    """`avail` seconds of computing from `phase` (compute since the last stall ended):
    (stalls, compute, compute lost back to the last durable checkpoint, phase after)."""
    cycle = ck.every_s + ck.stall_s
    x = phase + avail
    m = np.floor(x / cycle)
    r = x - m * cycle
    in_stall = r > ck.every_s
    stalls = m * ck.stall_s + np.where(in_stall, r - ck.every_s, 0.0)
    done = np.minimum(r, ck.every_s)
    # the last checkpoint not yet durable: the one before it is what a restart reads
    lost = done + np.where((m >= 1) & (r < ck.persist_s), ck.every_s, 0.0)
    return stalls, avail - stalls, lost, done


class _Pools:
    """Spare GPUs per node and standby nodes, per seed."""

    def __init__(self, seeds: int, job: Job, strategy: Strategy) -> None:
        spares = job.spares_per_node if strategy in (Strategy.SPARES,
                                                     Strategy.SPARES_STANDBY) else 0
        standby = job.standby_nodes if strategy == Strategy.SPARES_STANDBY else 0
        self.spares = np.full((seeds, job.nodes), spares, dtype=np.int32)
        self.full = spares
        self.standby_back = np.zeros((seeds, standby))  # when each standby slot is ready

    def take_spare(self, mask, node) -> np.ndarray:
        """Seeds in `mask` whose failed node has a spare GPU left use one: which did."""
        rows = np.arange(len(node))
        has = mask & (self.spares[rows, node] > 0)
        self.spares[rows[has], node[has]] -= 1
        return has

    def take_standby(self, mask, t, back) -> np.ndarray:
        """Seeds in `mask` with a standby node ready at `t` use it until `back`."""
        if self.standby_back.shape[1] == 0:
            return np.zeros_like(mask)
        free = self.standby_back <= t[:, None]
        slot = np.argmax(free, axis=1)
        has = mask & free.any(axis=1)
        rows = np.arange(len(t))[has]
        self.standby_back[rows, slot[has]] = back[has]
        return has

    def replace_node(self, mask, node) -> None:
        """A lost node comes back (later) with its spares whole: counted at once."""
        rows = np.arange(len(node))[mask]
        self.spares[rows, node[mask]] = self.full


def simulate(draws: Draws, job: Job, failures: Failures, scale: Scale, strategy: Strategy,
             checkpoints: Checkpoints | None = None) -> Outcome:
    """The job under `strategy` through `draws` (pure: same inputs, same result)."""
    ck = checkpoints or Checkpoints.for_job(job, scale, failures)
    seeds, horizon = draws.seeds, job.horizon_s
    acc = {c: np.zeros(seeds) for c in CHARGED}
    compute = np.zeros(seeds)  # gross compute; productive is what is left of it at the end
    t_free = np.zeros(seeds)
    phase = np.zeros(seeds)
    pools = _Pools(seeds, job, strategy)
    costs = _Costs(job, scale)
    for j in range(draws.t.shape[1]):
        t = draws.t[:, j]
        active = t < horizon
        if not active.any():
            break
        avail = np.where(active, np.maximum(np.where(active, t, 0.0) - t_free, 0.0), 0.0)
        stalls, done, lost_ckpt, phase_end = _segment(avail, phase, ck)
        acc[Category.CHECKPOINT_SAVE] += stalls
        compute += done
        interrupts = active & (draws.kind[:, j] != _K[Kind.STRAGGLER])  # a straggler slows
        refund = np.where(interrupts & (t < t_free), t_free - t, 0.0)  # a recovery cut short
        acc[Category.INFRASTRUCTURE_RECOVERY] -= refund
        down, wasted, deduct, new_phase = _outcome(
            strategy, draws.kind[:, j], draws.node[:, j], t, active, lost_ckpt,
            np.where(t < t_free, phase, phase_end), costs, pools, job, horizon)
        acc[Category.INFRASTRUCTURE_RECOVERY] += np.where(active, down, 0.0)
        acc[Category.WASTED_PROGRESS] += np.where(active, wasted, 0.0)
        compute -= np.where(active, wasted, 0.0)
        for category, amount in deduct.items():
            acc[category] += np.where(active, amount, 0.0)
            compute -= np.where(active, amount, 0.0)
        t_free = np.where(interrupts, t + down, np.where(active, np.maximum(t_free, t), t_free))
        phase = np.where(active, new_phase, phase)
    stalls, done, _, _ = _segment(np.maximum(horizon - t_free, 0.0), phase, ck)
    acc[Category.CHECKPOINT_SAVE] += stalls
    compute += done
    acc[Category.INFRASTRUCTURE_RECOVERY] -= np.maximum(t_free - horizon, 0.0)
    acc[Category.PRODUCTIVE_STEP] = compute
    return Outcome(seconds=acc, failures=draws.count(horizon), horizon_s=horizon)


@dataclass(frozen=True)
class _Costs:
    """One scale's costs, looked up once per simulation."""

    restart: float
    switch: float
    spare: float
    detect: dict[Kind, float]
    node_replace: float
    replica_frac: float
    node_frac: float
    sdc_steps: int
    straggler_steps: int

    def __init__(self, job: Job, scale: Scale) -> None:
        set_ = object.__setattr__
        set_(self, "restart", scale.restart_s(job))
        set_(self, "switch", scale.switch_s(job))
        set_(self, "spare", scale.spare_s(job))
        set_(self, "detect", {k: scale.detect_s(k, job) for k in Kind})
        set_(self, "node_replace", scale.node_replace_s(job))
        set_(self, "replica_frac", min(1.0, job.replica_gpus / job.gpus))
        per_node = math.ceil(job.gpus_per_node / job.replica_gpus) * job.replica_gpus
        set_(self, "node_frac", min(1.0, per_node / job.gpus))
        # an SDC with replica checks costs the rollback to the copy verified at the check
        # before it: K steps at most (the cap; anomalies.py found one in 36 of K = 39)
        set_(self, "sdc_steps", scale.measured.sdc_every_steps)
        set_(self, "straggler_steps", scale.measured.straggler_detect_steps)


def _outcome(strategy, kind, node, t, active, lost_ckpt, phase, c: _Costs, pools: _Pools,
             job: Job, horizon: float):
    """What each seed's failure costs under `strategy`: (downtime, lost work, deductions
    from compute by category, checkpoint phase after)."""
    is_ = {k: active & (kind == _K[k]) for k in Kind}
    left = np.maximum(horizon - t, 0.0)
    slow = job.straggler_factor
    straggle_all = np.minimum(job.straggler_s, left) * (1.0 - 1.0 / slow)
    zero = np.zeros_like(t)
    if strategy == Strategy.TORCHRUN:
        down = np.full_like(t, c.restart) + np.where(is_[Kind.HANG], job.torchrun_hang_s, 0.0)
        wasted = lost_ckpt + np.where(is_[Kind.SDC], np.minimum(job.sdc_found_after_s, t), 0.0)
        down = np.where(is_[Kind.STRAGGLER], 0.0, down)
        wasted = np.where(is_[Kind.STRAGGLER], 0.0, wasted)
        new_phase = np.where(is_[Kind.STRAGGLER], phase, 0.0)
        return down, wasted, {Category.STRAGGLER: np.where(is_[Kind.STRAGGLER],
                                                           straggle_all, 0.0)}, new_phase
    step_lost = np.full_like(t, job.step_s / 2.0)
    sdc_lost = np.full_like(t, c.sdc_steps * job.step_s)
    detect = np.select([is_[Kind.HANG], is_[Kind.NODE_LOST]],
                       [c.detect[Kind.HANG], c.detect[Kind.NODE_LOST]], c.detect[Kind.CRASH])
    # who gets a spare GPU on its node (crash, SDC's guilty GPU, a drained straggler;
    # a hang's GPU is healthy, so its spare is refilled by a new process: not consumed)
    gpu_gone = is_[Kind.CRASH] | is_[Kind.SDC] | is_[Kind.STRAGGLER]
    spared = pools.take_spare(gpu_gone, node) | (is_[Kind.HANG] & (pools.full > 0))
    standby = pools.take_standby(is_[Kind.NODE_LOST], t, t + c.node_replace)
    pools.replace_node(is_[Kind.NODE_LOST], node)
    # without a spare: shrink until the capacity comes back, then switch again to grow
    window = np.select([is_[Kind.HANG], is_[Kind.NODE_LOST]],
                       [job.worker_start_s, c.node_replace], c.node_replace)
    frac = np.where(is_[Kind.NODE_LOST], c.node_frac, c.replica_frac)
    shrinks = active & ~spared & ~standby & ~is_[Kind.STRAGGLER]
    window = np.minimum(window, left)
    cannot = frac >= 1.0  # one replica: nothing to shrink to, the job waits instead
    down = detect + np.where(spared | standby, c.spare, c.switch)
    down = down + np.where(shrinks & cannot, window, 0.0)
    capacity = np.where(shrinks & ~cannot, frac * window, 0.0)
    grow = np.where(shrinks & ~cannot & (window < left), c.switch, 0.0)
    wasted = np.where(is_[Kind.SDC], sdc_lost, step_lost)
    drained = is_[Kind.STRAGGLER] & spared
    detect_window = np.minimum(c.straggler_steps * job.step_s * slow, left)
    straggle = np.where(drained, detect_window * (1.0 - 1.0 / slow), straggle_all)
    # a drain is downtime too, but a straggler does not stop the job: charged from compute
    grow = grow + np.where(drained, c.spare, 0.0)
    down = np.where(is_[Kind.STRAGGLER], 0.0, down)
    wasted = np.where(is_[Kind.STRAGGLER], 0.0, wasted)
    straggle = np.where(is_[Kind.STRAGGLER], straggle, 0.0)
    return down, wasted, {Category.CAPACITY_LOST: capacity,
                          Category.INFRASTRUCTURE_RECOVERY: grow,
                          Category.STRAGGLER: straggle}, phase + zero

