"""The simulation: one job's wall time, charged to the goodput categories, per seed.

Pure and vectorised: every array holds one value per seed, and the loop walks the failures
in time order (column j of `Draws` is each seed's j-th failure). Between failures the job
computes, stalling for a checkpoint every `Checkpoints.every_s` of compute (the cycle's
position carries across failures that do not restart the job). At a failure the
strategy's outcome (`_outcome`) decides what the job pays:

- `infrastructure_recovery`: downtime, detection included; a failure during a recovery
  starts it again (the unfinished part is refunded), but never ends a wait for a node the
  job cannot run without (`blocked_until`);
- `wasted_progress`: computed work lost (back to the last durable checkpoint, or the step
  in flight when survivors keep their state), never more than the job has computed;
- `capacity_lost` and `straggler`: windows of time in which a share of the job's compute
  is lost (it runs shrunk; a slow GPU holds every step back), charged only on the compute
  that falls inside them; the switch that ends a shrink or a drain is charged when the
  window ends;
- `checkpoint_save`: the loop's stalls.

Every seed's categories sum to its wall time and none is negative (`Outcome.check`, run on
every result). Simplifications, stated in docs/simulate.md: windows of one kind that
overlap are merged (their shares add, until the later end); a spare GPU, once used, stays
used until its node is replaced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from unbroken.checkpoint.interval import daly_interval
from unbroken.simulate.draws import KINDS, Draws
from unbroken.simulate.inputs import CheckpointMode, Failures, Job, Kind, Scale, Strategy
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

    def __post_init__(self) -> None:
        # Never below the time a checkpoint takes to persist, as the checkpointer does: a
        # restart then reads at most one interval further back than the last stall.
        object.__setattr__(self, "every_s", max(self.every_s, self.persist_s))

    @classmethod
    def for_job(cls, job: Job, scale: Scale, failures: Failures) -> Checkpoints:
        """The job's cadence: `job.checkpoint_every_s`, else Young/Daly (Daly's form, as the
        checkpointer computes it) for the stall and the job's MTTF, never below the time a
        checkpoint takes to persist."""
        stall, persist = scale.checkpoint_stall_s(job), scale.checkpoint_persist_s(job)
        every = job.checkpoint_every_s
        if every is None:
            every = daly_interval(stall, failures.job_mttf_s(job.gpus))
        return cls(every_s=every, stall_s=stall, persist_s=persist)

    @classmethod
    def for_strategy(cls, job: Job, scale: Scale, failures: Failures,
                     strategy: Strategy) -> Checkpoints:
        """The restart-style arm checkpoints as the job does today (`Job.checkpoint`); with
        synchronous saves today, unbroken's arms save asynchronously at Young/Daly's cadence
        for their own stall. Without `Job.checkpoint`, every arm as `for_job`."""
        if job.checkpoint is None and job.checkpoint_stall_s is None:
            return cls.for_job(job, scale, failures)
        mttf = failures.job_mttf_s(job.gpus)
        if strategy != Strategy.TORCHRUN:
            if job.checkpoint != CheckpointMode.SYNC:
                return cls.for_job(job, scale, failures)
            stall = scale.checkpoint_stall_s(job)
            return cls(every_s=daly_interval(stall, mttf), stall_s=stall,
                       persist_s=scale.checkpoint_persist_s(job))
        if job.checkpoint == CheckpointMode.SYNC:  # durable when the loop goes on
            stall = job.checkpoint_stall_s or scale.checkpoint_persist_s(job)
            every = job.checkpoint_every_s or daly_interval(stall, mttf)
            return cls(every_s=every, stall_s=stall, persist_s=0.0)
        ours = cls.for_job(job, scale, failures)
        stall = job.checkpoint_stall_s or ours.stall_s
        every = job.checkpoint_every_s or daly_interval(stall, mttf)
        return cls(every_s=every, stall_s=stall, persist_s=ours.persist_s)


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


class _Cycle:
    """Where each seed stands in its checkpoint cycle (compute `every`, then a stall):
    `r`, seconds into the cycle since the last stall ended (or the job restarted), and
    `fresh`, whether that stall's checkpoint was taken in this run (so may not be durable
    yet; a restart resumes from a durable one)."""

    def __init__(self, seeds: int, ck: Checkpoints) -> None:
        self.ck = ck
        self.r = np.zeros(seeds)
        self.fresh = np.zeros(seeds, dtype=bool)

    def _stalled(self, y):
        """Stall seconds in [0, y] of cycle time."""
        ck = self.ck
        cycle = ck.every_s + ck.stall_s
        return np.floor(y / cycle) * ck.stall_s + np.clip(np.mod(y, cycle) - ck.every_s,
                                                            0.0, ck.stall_s)

    def run(self, avail, mask):
        """`avail` seconds pass in the cycle for seeds in `mask`: (stall seconds among them,
        compute that would be lost back to the last durable checkpoint now)."""
        ck = self.ck
        cycle = ck.every_s + ck.stall_s
        x = self.r + avail
        stalls = self._stalled(x) - self._stalled(self.r)
        r = np.mod(x, cycle)
        fresh = self.fresh | (np.floor(x / cycle) >= 1)
        lost = np.minimum(r, ck.every_s) + np.where(fresh & (r < ck.persist_s), ck.every_s, 0.0)
        self.r = np.where(mask, r, self.r)
        self.fresh = np.where(mask, fresh, self.fresh)
        return np.where(mask, stalls, 0.0), lost

    def restart(self, mask) -> None:
        """Seeds in `mask` resume from their last durable checkpoint."""
        self.r = np.where(mask, 0.0, self.r)
        self.fresh = np.where(mask, False, self.fresh)


@dataclass
class _Windows:
    """One kind of window per seed (shrunk, or slowed): from `start` to `end` a share
    `frac` of the compute is lost; `pending` seconds of downtime (the switch that ends it)
    are charged once a segment reaches `end`."""

    start: np.ndarray
    end: np.ndarray
    frac: np.ndarray
    pending: np.ndarray = field(default=None)  # type: ignore[assignment]

    @classmethod
    def empty(cls, seeds: int) -> _Windows:
        z = np.zeros(seeds)
        return cls(z.copy(), z.copy(), z.copy(), z.copy())

    def add(self, mask, t, start, end, frac, pending) -> None:
        """Open a window for seeds in `mask`; one still open is merged into it."""
        open_ = self.end > t
        self.frac = np.where(mask, np.minimum(1.0, np.where(open_, self.frac, 0.0) + frac),
                             self.frac)
        self.start = np.where(mask, np.where(open_, t, start), self.start)
        self.end = np.where(mask, np.maximum(np.where(open_, self.end, 0.0), end), self.end)
        self.pending = np.where(mask, self.pending + pending, self.pending)

    def charge(self, s0, s1, done):
        """On a segment [s0, s1] of which `done` seconds computed: (compute lost to the
        window, downtime of its end reached)."""
        span = np.maximum(s1 - s0, 1e-12)
        overlap = np.clip(np.minimum(s1, self.end) - np.maximum(s0, self.start), 0.0, None)
        lost = np.minimum(self.frac * overlap * done / span, done)
        ended = (self.end <= s1) & (self.pending > 0)
        switch = np.where(ended, np.minimum(self.pending, done - lost), 0.0)
        self.pending = np.where(ended, self.pending - switch, self.pending)
        return lost, switch


def simulate(draws: Draws, job: Job, failures: Failures, scale: Scale, strategy: Strategy,
             checkpoints: Checkpoints | None = None) -> Outcome:
    """The job under `strategy` through `draws` (pure: same inputs, same result)."""
    ck = checkpoints or Checkpoints.for_strategy(job, scale, failures, strategy)
    seeds, horizon = draws.seeds, job.horizon_s
    acc = {c: np.zeros(seeds) for c in CHARGED}
    compute = np.zeros(seeds)  # net compute so far: productive at the end
    t_free = np.zeros(seeds)  # when the job computes again
    blocked = np.zeros(seeds)  # the job cannot compute before this (a node it needs)
    cycle = _Cycle(seeds, ck)
    shrunk, slowed = _Windows.empty(seeds), _Windows.empty(seeds)
    pools = _Pools(seeds, job, strategy)
    costs = _Costs(job, scale)

    def advance(until, mask):
        """Compute from t_free to `until` for seeds in `mask`: (compute lost back to the
        last durable checkpoint at `until`)."""
        nonlocal compute
        s0 = t_free
        avail = np.where(mask, np.maximum(until - s0, 0.0), 0.0)
        stalls, lost = cycle.run(avail, mask)
        done = avail - stalls
        acc[Category.CHECKPOINT_SAVE] += stalls
        for windows, category in ((shrunk, Category.CAPACITY_LOST),
                                  (slowed, Category.STRAGGLER)):
            cut, switch = windows.charge(s0, s0 + avail, done)
            cut, switch = np.where(mask, cut, 0.0), np.where(mask, switch, 0.0)
            acc[category] += cut
            acc[Category.INFRASTRUCTURE_RECOVERY] += switch
            done = done - cut - switch
        compute = compute + done
        return lost

    for j in range(draws.t.shape[1]):
        active = draws.t[:, j] < horizon
        if not active.any():
            break
        t = np.where(active, draws.t[:, j], 0.0)  # past a seed's last failure: no failure
        kind = draws.kind[:, j]
        lost_ckpt = advance(np.where(active, t, 0.0), active & (t > t_free))
        interrupts = active & (kind != _K[Kind.STRAGGLER])
        # a recovery cut short: its rest is refunded, but not a wait for a needed node
        base = np.where(t < t_free, np.maximum(t, np.minimum(blocked, t_free)), t)
        acc[Category.INFRASTRUCTURE_RECOVERY] -= np.where(interrupts, t_free - base, 0.0) * \
            (t < t_free)
        out = _outcome(strategy, kind, draws.node[:, j], t, active, costs, pools, job, horizon)
        wasted = np.minimum(np.where(interrupts, out.wasted + np.where(
            out.to_checkpoint, lost_ckpt, 0.0), 0.0), compute)
        acc[Category.WASTED_PROGRESS] += wasted
        compute = compute - wasted
        blocked = np.where(interrupts, np.maximum(blocked, out.blocked_until), blocked)
        resume = np.maximum(np.maximum(t + out.down, blocked), base)
        acc[Category.INFRASTRUCTURE_RECOVERY] += np.where(interrupts, resume - base, 0.0)
        cycle.restart(interrupts & out.to_checkpoint)
        shrunk.add(out.shrink_frac > 0, t, resume, resume + out.shrink_s, out.shrink_frac,
                   out.grow_s)
        slowed.add(out.slow_frac > 0, t, t, t + out.slow_s, out.slow_frac, out.drain_s)
        t_free = np.where(interrupts, resume, np.where(active, np.maximum(t_free, t), t_free))
    advance(np.full(seeds, horizon), t_free < horizon)
    acc[Category.INFRASTRUCTURE_RECOVERY] -= np.maximum(t_free - horizon, 0.0)
    acc[Category.PRODUCTIVE_STEP] = compute
    out = Outcome(seconds=acc, failures=draws.count(horizon), horizon_s=horizon)
    out.check()
    return out


class _Pools:
    """Spare GPUs per node and standby nodes, per seed."""

    def __init__(self, seeds: int, job: Job, strategy: Strategy) -> None:
        spares = job.spares_per_node if strategy in (Strategy.SPARES,
                                                     Strategy.SPARES_STANDBY) else 0
        standby = job.standby_nodes if strategy == Strategy.SPARES_STANDBY else 0
        # Spares are within the node: a job with spares holds more nodes than the draws
        # number (`Job.spare_nodes`); a failure on drawn node k falls on node k * held / drawn.
        self.held = job.spare_nodes if spares else job.nodes
        self.drawn = job.nodes
        self.spares = np.full((seeds, self.held), spares, dtype=np.int32)
        self.full = spares
        self.standby_back = np.zeros((seeds, standby))  # when each standby slot is ready

    def take_spare(self, mask, node) -> np.ndarray:
        """Seeds in `mask` whose failed node has a spare GPU left use one: which did."""
        rows = np.arange(len(node))
        node = node * self.held // self.drawn
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
        self.spares[rows, (node * self.held // self.drawn)[mask]] = self.full


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


@dataclass(frozen=True)
class _Failed:
    """What each seed's failure does under a strategy (arrays; zero where not applicable)."""

    down: np.ndarray
    """Downtime from the failure: detection, the switch or restart, a wait."""
    wasted: np.ndarray
    """Compute lost besides any rollback to the checkpoint."""
    to_checkpoint: np.ndarray
    """Rolls back to the last durable checkpoint (a restart)."""
    blocked_until: np.ndarray
    """The job cannot compute before this (0: no such wait)."""
    shrink_s: np.ndarray
    shrink_frac: np.ndarray
    grow_s: np.ndarray
    slow_s: np.ndarray
    slow_frac: np.ndarray
    drain_s: np.ndarray


def _outcome(strategy, kind, node, t, active, c: _Costs, pools: _Pools, job: Job,
             horizon: float) -> _Failed:
    """What each seed's failure costs under `strategy`."""
    is_ = {k: active & (kind == _K[k]) for k in Kind}
    zero = np.zeros_like(t)
    slow = 1.0 - 1.0 / job.straggler_factor
    straggles = is_[Kind.STRAGGLER]
    if strategy == Strategy.TORCHRUN:
        down = np.full_like(t, c.restart) + np.where(is_[Kind.HANG], job.torchrun_hang_s, 0.0)
        return _Failed(
            down=down, wasted=np.where(is_[Kind.SDC], job.sdc_found_after_s, 0.0),
            to_checkpoint=active & ~straggles, blocked_until=zero, shrink_s=zero,
            shrink_frac=zero, grow_s=zero, slow_s=np.where(straggles, job.straggler_s, 0.0),
            slow_frac=np.where(straggles, slow, 0.0), drain_s=zero)
    detect = np.select([is_[Kind.HANG], is_[Kind.NODE_LOST]],
                       [c.detect[Kind.HANG], c.detect[Kind.NODE_LOST]], c.detect[Kind.CRASH])
    # who gets a spare GPU on its node (crash, SDC's guilty GPU, a drained straggler;
    # a hang's GPU is healthy, so its spare is refilled by a new process: not consumed)
    gpu_gone = is_[Kind.CRASH] | is_[Kind.SDC] | straggles
    spared = pools.take_spare(gpu_gone, node) | (is_[Kind.HANG] & (pools.full > 0))
    standby = pools.take_standby(is_[Kind.NODE_LOST], t, t + c.node_replace)
    pools.replace_node(is_[Kind.NODE_LOST], node)
    # without a spare: shrink until the capacity comes back, then switch again to grow
    window = np.select([is_[Kind.HANG], is_[Kind.NODE_LOST]],
                       [job.worker_start_s, c.node_replace], c.node_replace)
    frac = np.where(is_[Kind.NODE_LOST], c.node_frac, c.replica_frac)
    shrinks = active & ~spared & ~standby & ~straggles
    cannot = shrinks & (frac >= 1.0)  # one replica: nothing to shrink to, the job waits
    down = detect + np.where(spared | standby, c.spare, c.switch)
    down = np.where(cannot, down + window, down)
    drained = straggles & spared
    return _Failed(
        down=np.where(straggles, 0.0, down),
        wasted=np.where(is_[Kind.SDC], c.sdc_steps * job.step_s, job.step_s / 2.0),
        to_checkpoint=np.zeros_like(active),
        blocked_until=np.where(cannot, t + detect + window, 0.0),
        shrink_s=np.where(shrinks & ~cannot, window, 0.0),
        shrink_frac=np.where(shrinks & ~cannot, frac, 0.0),
        grow_s=np.where(shrinks & ~cannot, c.switch, 0.0),
        slow_s=np.where(drained, c.straggler_steps * job.step_s * job.straggler_factor,
                        np.where(straggles, job.straggler_s, 0.0)),
        slow_frac=np.where(straggles, slow, 0.0),
        drain_s=np.where(drained, c.spare, 0.0))
