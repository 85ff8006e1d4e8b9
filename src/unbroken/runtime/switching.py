"""One worker's moves between generations, for the engine: leave, then join with the newest
state; and whether its state can move in place at all.

The `Switcher` does the generation protocol's I/O (through `Generations`) and the state
step (replicated: `state_sync`; sharded: `ShardedSync`), and returns where the worker then
stands; the engine applies it (`Engine._move`). It never writes the engine's position.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unbroken.control.messages import LeaveReason
from unbroken.runtime.checkpoint_duty import CheckpointDuty
from unbroken.runtime.config import EngineSettings
from unbroken.runtime.generations.membership import Drained, JobFinished, Plan, RecoveryTimeout
from unbroken.runtime.generations.recovery import Generations, Switch
from unbroken.runtime.generations.state_sync import NoStateError, SyncResult, pack
from unbroken.runtime.groups.process_group import AbortableGroups, CheckpointGroups
from unbroken.runtime.position import Position
from unbroken.runtime.tracked import TrackedState
from unbroken.telemetry import schema as ev

if TYPE_CHECKING:  # DTensor's machinery: imported only for a sharded model (prepare_sharded)
    from unbroken.checkpoint.staging import HostImage
    from unbroken.runtime.sharded.shard_sync import ShardedSync


class NotNeeded(Exception):
    """The job no longer needs this worker: it ended first, or (`drained`) a spare took the
    worker's rank with the state it left with. The worker exits 0."""

    def __init__(self, drained: bool) -> None:
        super().__init__("drained" if drained else "the job finished")
        self.drained = drained


class Switcher:
    """Leaving and joining generations in place, for one worker."""

    def __init__(self, generations: Generations, settings: EngineSettings, events: ev.Emit,
                 checkpoints: CheckpointDuty) -> None:
        self.generations, self.settings = generations, settings
        self.record, self.checkpoints = events, checkpoints
        self.sharded: ShardedSync | None = None
        """Sharded state's switch (FSDP2, HSDP), once `prepare` found the model sharded."""

    def prepare_sharded(self, tracked: TrackedState, position: Position, joining: bool,
                        groups: AbortableGroups, available: int,
                        say: Callable[[str], None]) -> str | None:
        """Set up the sharded state step for a sharded model; why it cannot recover in
        place (one line), or None. `available`: host memory per rank, in bytes."""
        s = self.settings
        from unbroken.runtime.sharded.shard_sync import build_sharded

        sync = build_sharded(
            tracked.model, tracked.optimizers, tracked.extra, world_size=position.world_size,
            joining=joining, snapshot_every=s.snapshot_every,
            snapshot_replicas=s.snapshot_replicas, groups=groups, local_world=s.local_world,
            timeout=s.timeout, available=available, record=self.record, say=say)
        if isinstance(sync, str):
            return sync
        self.sharded = sync
        self.generations.sharded = True
        return None

    def check(self, tracked: TrackedState, position: Position) -> str | None:
        """Before the first step: why this state cannot move between peers, or None. Sharded
        state forms generation 0's mesh on groups a leave can abort (collective)."""
        if self.sharded is not None:
            if (why := self.sharded.shards.unresettable()) is not None:
                return why
            self.sharded.form(position.rank, position.world_size)
            return None
        try:
            pack(tracked.state_dict(position.step, rng=False))
        except TypeError as exc:
            return str(exc)
        return None

    def leave(self, position: Position, reason: LeaveReason, **detail: Any) -> None:
        """Leave the current generation (peers blocked on us fail now), saying what we hold."""
        t0 = time.monotonic()
        drained = self.generations.leave(position.step, position.holds_state, reason, **detail)
        self.record(ev.GenLeave(gen=position.gen, step=position.step, reason=reason.value,
                                holds_state=position.holds_state,
                                duration=round(time.monotonic() - t0, 6),
                                error=detail.get("error"), drained=drained))

    def join(self, position: Position, tracked: TrackedState,
             build: Callable[[Position], Any], *, joining: bool, slot: int,
             reason: str) -> Switch:
        """Wait for the next generation naming us and switch to it with the newest state;
        `build(position)` makes the view in it. Raises `NotNeeded`, or `NoStateError` once
        the leader's fallback (a full restart) is under way."""
        t0 = time.monotonic()
        gens = self.generations
        if joining:
            gens.membership.register_joiner(slot)
        sync = self._sync_shards(tracked) if self.sharded is not None else gens.replicated(
            lambda: tracked.state_dict(position.step, rng=False), tracked.restore)
        try:
            switch = gens.join(position, sync, build, lambda: tracked.whole, joining=joining,
                               formed=self._formed)
        except (JobFinished, Drained) as exc:
            drained = isinstance(exc, Drained)
            self.record(ev.Drained(slot=slot, step=position.step, pid=os.getpid()) if drained
                        else ev.JoinerUnused(slot=slot))
            raise NotNeeded(drained) from exc
        except NoStateError:
            # We left saying why (`switch_failed`); the leader now restarts every worker from
            # the checkpoint, and stops us. Exiting first would read as a fault of our own.
            try:
                gens.membership.await_finished()
            except RecoveryTimeout:
                pass
            raise
        gens.report_up(switch)
        pos = switch.position
        self.record(ev.GenSwitch(gen=pos.gen, reason=reason, step=pos.step,
                                 world_size=pos.world_size, state_from=switch.sync.source,
                                 received_bytes=switch.sync.received_bytes, tries=switch.tries,
                                 rolled_back=switch.rolled_back,
                                 duration=round(time.monotonic() - t0, 6), **switch.phases))
        return switch

    def _sync_shards(self, tracked: TrackedState) -> Callable[[Plan, int, bool], SyncResult]:
        """The state step of a sharded switch: this rank's shard at the step every shard is
        held at, from itself, a replica or a buddy's snapshot."""
        def sync(plan: Plan, committed_step: int, holds_state: bool) -> SyncResult:
            result = self.sharded.sync(
                plan.rank, plan.world_size, committed_step, holds_state, torn=tracked.tear,
                before_send=lambda step: self.generations.fault_point("send", step))
            tracked.whole = True
            shard_plan = self.sharded.plan
            self.record(ev.ShardSync(
                gen=plan.gen, step=result.step, committed=committed_step if holds_state else None,
                restored=plan.rank in shard_plan.restore, sender=result.source,
                received_bytes=result.received_bytes,
                transfers=[[t.src, t.dst, t.live] for t in shard_plan.transfers]))
            return result
        return sync

    def _formed(self, plan: Plan, groups: CheckpointGroups | None, step: int) -> None:
        """In a new generation: checkpoint over its groups, on a schedule its members agree."""
        self.checkpoints.rejoin(groups, plan.gen, step)

    def after_commit(self, step: int, last_step: int, step_time: float | None,
                     checkpoint_due: bool = False,
                     checkpoint_every: int | None = None) -> HostImage | None:
        """After a committed step: a snapshot round if one is due, or a checkpoint is
        (sharded state); the round's host copy for that checkpoint, or None."""
        if self.sharded is None:
            return None
        return self.sharded.after_commit(step, last_step, step_time, checkpoint_due,
                                         checkpoint_every)

    def close(self) -> bool:
        """Wait for a snapshot round in flight; False if one was still running after 30 s."""
        return self.sharded is None or self.sharded.close(timeout=30.0)
