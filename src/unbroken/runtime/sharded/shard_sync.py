"""Switching a sharded job into a new generation: rebind the model to the new groups, agree
on the step to resume from (`shard_plan`), and bring each rank its shard, from itself, a
replica or a buddy's in-memory snapshot; never from storage.

Collective over the new generation, called by `Generations.join` once the default group is
formed. A world of another size (a shrink) is refused: sharded state would have to be
resharded, so a sharded job waits for the lost ranks' replacements (the leader's policy
for sharded departures) and falls back to the storage checkpoint rather than corrupt.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from unbroken.runtime.generations.state_sync import (
    NoStateError,
    SyncResult,
    recv_bytes,
    send_tensors,
)
from unbroken.runtime.groups.process_group import AbortableGroups
from unbroken.runtime.sharded.shard_plan import Holding, ShardPlan, Unrecoverable, plan_shards
from unbroken.runtime.sharded.shards import LocalShards, new_mesh
from unbroken.runtime.sharded.snapshot_pacer import SnapshotPacer
from unbroken.runtime.sharded.snapshots import PeerSnapshots, RoundImage

# int64s per member in the inventory: started (-1: no snapshots), interval (0: undecided),
# count, then (shard, step, live) for up to _HOLDINGS copies
_HOLDINGS = 32
_ROW = 3 + 3 * _HOLDINGS


def snapshot_group(timeout: float) -> dist.ProcessGroup:
    """The gloo group snapshots and shard transfers travel on (collective)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))


class ShardedSync:
    """One sharded job's switches; `sync` is `Generations.join`'s state step."""

    def __init__(self, shards: LocalShards, snapshots: PeerSnapshots | None,
                 groups: AbortableGroups, local_world: int, timeout: float,
                 record: Callable[..., None]) -> None:
        self.shards, self.snapshots, self.groups = shards, snapshots, groups
        self.local_world, self.timeout, self.record = local_world, timeout, record
        self.plan: ShardPlan | None = None  # the last switch's
        self.pacer: SnapshotPacer | None = None  # when to take rounds; set by `build_sharded`

    def after_commit(self, step: int, last_step: int, step_seconds: float | None,
                     checkpoint_due: bool = False,
                     checkpoint_every: int | None = None) -> RoundImage | None:
        """After a committed step: a snapshot round if the pacer says one is due, or a
        checkpoint is; the round's copy for that checkpoint to persist from, or None."""
        if self.snapshots is None or self.pacer is None:
            return None
        image = self.pacer.after_commit(step, last_step, step_seconds, checkpoint_due,
                                        checkpoint_every)
        if self.pacer.refused:
            self.snapshots = None
        return image

    def rollback(self) -> int | None:
        """Back to every rank's own host copy, if they are of one step (collective over the
        snapshot group); that step, or None (nothing changes: roll back from storage)."""
        return self.snapshots.rollback() if self.snapshots is not None else None

    def close(self, timeout: float = 30.0) -> bool:
        """Wait for a round in flight; False if one was still running after `timeout`."""
        return self.snapshots is None or self.snapshots.wait(timeout=timeout)

    def form(self, rank: int, world: int) -> dist.ProcessGroup:
        """Rebuild the mesh on the current default group, rebind the model to it, and form
        the snapshot group, all recorded so that leaving aborts them (collective)."""
        if world != self.shards.shape.size:
            raise NoStateError(
                f"sharded state cannot move to a world of {world} in place (it is sharded "
                f"over {self.shards.shape.size}): resharding needs the storage checkpoint")
        self.shards.reset_iteration()
        with self.groups.recording():
            fresh = new_mesh(self.shards.shape)
            group = snapshot_group(self.timeout)
        self.shards.rebind(fresh)
        if self.snapshots is not None:
            self.snapshots.use_group(group, rank, world, self.local_world)
        return group

    def sync(self, rank: int, world: int, committed_step: int, holds_state: bool,
             torn: Callable[[], None] = lambda: None,
             before_send: Callable[[int], None] = lambda step: None) -> SyncResult:
        """`torn()` is called just before this rank's live state is first overwritten (a
        receipt or a restore): from then on it holds no committed state until this returns.
        `before_send(step)`: just before this rank sends a shard of `step` (injected faults
        at the `send` point)."""
        group = self.form(rank, world)
        snaps = self.snapshots
        mine: list[tuple[int, int, int]] = []
        if holds_state:
            mine.append((self.shards.shard_index(rank), committed_step, 1))
        if snaps is not None:
            mine += [(shard, step, 0) for shard, step in snaps.holdings()]
        if len(mine) > _HOLDINGS:
            raise NoStateError(f"this rank holds {len(mine)} copies; at most {_HOLDINGS} can "
                               "be announced (fewer snapshot_replicas)")
        row = [int(snaps.started) if snaps else -1, (snaps.every or 0) if snaps else 0,
               len(mine)]
        for entry in mine:
            row += list(entry)
        row += [0] * (_ROW - len(row))
        table = [torch.zeros(_ROW, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(table, torch.tensor(row, dtype=torch.int64), group=group)
        holdings, rounds = [], []
        for member, t in enumerate(table):
            values = t.tolist()
            rounds.append((values[0], values[1]))
            for i in range(values[2]):
                shard, step, live = values[3 + 3 * i: 6 + 3 * i]
                holdings.append(Holding(member, shard, step, bool(live)))
        needs = [self.shards.shard_index(r) for r in range(world)]
        plan = plan_shards(needs, holdings)
        if isinstance(plan, Unrecoverable):
            raise NoStateError(plan.reason)
        self.plan = plan
        if snaps is not None:
            self._align_rounds(snaps, rounds, plan.step)  # may drop self.snapshots
        source, received = None, 0
        for t in plan.transfers:
            if t.src == rank:
                if t.live:
                    meta, tensors = self.shards.meta(), self.shards.tensors()
                else:
                    copy = snaps.find(needs[t.dst], plan.step)
                    meta, tensors = copy.meta, copy.views()
                before_send(plan.step)
                send_shard(meta, tensors, t.dst, group)
            elif t.dst == rank:
                torn()
                received = receive_shard(self.shards, t.src, group)
                source = t.src
        if rank in plan.restore:
            torn()
            snaps.restore(plan.step)
        if self.snapshots is not None:
            self.snapshots.forget_after(plan.step)
        return SyncResult(step=plan.step, source=source, received_bytes=received)

    def _align_rounds(self, snaps: PeerSnapshots, rounds: list[tuple[int, int]],
                      step: int) -> None:
        """Every member leaves the switch at the same point of the snapshot schedule, so
        that later rounds pair up: none if any member takes none; the agreed interval if
        the members that started have one (a joiner adopts it); else all start over."""
        if any(started < 0 for started, _ in rounds):
            self.snapshots = None
            return
        agreed = {every for started, every in rounds if started == 1}
        if len(agreed) == 1 and (every := agreed.pop()) > 0:
            snaps.adopt(every, step)
        else:
            snaps.restart_rounds()


def send_shard(meta: dict[str, Any], tensors: list[torch.Tensor], dst: int,
               group: dist.ProcessGroup) -> None:
    """Send one shard (live tensors, or a snapshot's flat buffer) and its plain data to
    `dst`, streamed through one host chunk."""
    blob = json.dumps(meta).encode()
    total = sum(t.numel() * t.element_size() for t in tensors)
    dist.send(torch.tensor([len(blob), total], dtype=torch.int64), dst=dst, group=group)
    dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=dst, group=group)
    send_tensors(tensors, total, dst, group, torch.device("cpu"))


def receive_shard(shards: LocalShards, src: int, group: dist.ProcessGroup) -> int:
    """Receive `send_shard`'s stream from `src` into the live state; the bytes received."""
    sizes = torch.zeros(2, dtype=torch.int64)
    dist.recv(sizes, src=src, group=group)
    blob = torch.empty(int(sizes[0]), dtype=torch.uint8)
    dist.recv(blob, src=src, group=group)
    payload = recv_bytes(int(sizes[1]), src, group, torch.device("cpu"))
    try:
        shards.load(payload)
    except ValueError as exc:  # another layout than ours: never load it half
        raise NoStateError(f"the shard from rank {src} does not fit this rank's: {exc}") from exc
    shards.load_meta(json.loads(bytes(blob.numpy()).decode()))
    return int(sizes[1])


def build_sharded(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                  extra: dict[str, Any], *, world_size: int, joining: bool,
                  snapshot_every: int | None, snapshot_replicas: int, groups: AbortableGroups,
                  local_world: int, timeout: float, available: int,
                  record: Callable[..., None], say: Callable[[str], None]) -> ShardedSync | str:
    """The sharded switch for a tracked FSDP2/HSDP model, or why in-place recovery cannot
    serve it (one line). `snapshot_every=0`: no in-memory snapshots; `available`: host
    memory per rank, for the pacer's agreement that snapshots fit."""
    try:
        shards = LocalShards(model, optimizers, extra)
    except TypeError as exc:
        return str(exc)
    why = shards.unsupported(world_size)
    if why is not None:
        return why
    if joining:
        shards.prime()  # its optimizer state exists, so its tensor list matches a holder's
    snapshots = None
    if snapshot_every != 0:
        snapshots = PeerSnapshots(shards, snapshot_replicas, snapshot_every, record)
    sync = ShardedSync(shards, snapshots, groups, local_world, timeout, record)
    if snapshots is not None:
        sync.pacer = SnapshotPacer(snapshots, available, record, say)
    return sync
