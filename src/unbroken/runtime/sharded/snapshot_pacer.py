"""When a sharded job takes its in-memory snapshot rounds: decided the same on every rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from unbroken.runtime.sharded.host_copy import HostBudget, auto_every, refusal
from unbroken.runtime.sharded.snapshots import PeerSnapshots, RoundImage
from unbroken.telemetry import schema as ev


class SnapshotPacer:
    """When to take a round: the snapshot interval policy, decided the same on every rank.

    Before the first round the ranks agree (collective) that snapshots fit in every rank's
    host memory; with `every=None` the first two rounds are timed and the ranks then agree
    on the interval (the largest proposal, never longer than the checkpoint interval), so
    that rounds pair up. Every storage checkpoint's step is a round too: the checkpoint
    persists from the round's own copy, and the newest in-memory copy is never older than
    the newest checkpoint."""

    def __init__(self, snaps: PeerSnapshots, available: int, record: Callable[..., None],
                 say: Callable[[str], None]) -> None:
        """`available`: host memory per rank, in bytes; `say`: a line for the user (rank 0
        prints it). The shards' size is read at each decision: the optimizer's state exists
        only after its first step."""
        self.snaps, self.available = snaps, available
        self.record, self.say = record, say
        self.refused = False
        """The ranks agreed that snapshots do not fit: none is taken any more."""

    @property
    def shard_bytes(self) -> int:
        return self.snaps.shards.nbytes()

    def budget(self) -> HostBudget:
        """The snapshots' host memory per rank now: the copies, and the exchange's ring on
        GPU."""
        return HostBudget(self.shard_bytes, self.snaps.replicas, self.snaps.transient_bytes())

    def after_commit(self, step: int, last_step: int, step_seconds: float | None,
                     checkpoint_due: bool = False,
                     checkpoint_every: int | None = None) -> RoundImage | None:
        """After committed step `step` (the next to run) of a run to `last_step`: start a
        round if one is due or a checkpoint is (collective when it decides). Returns the
        round's copy for the checkpoint to persist from when `checkpoint_due` (the writer
        then holds its lease), else None. `checkpoint_every`: the checkpoint interval in
        steps, which the snapshot interval never exceeds."""
        snaps = self.snaps
        if self.refused or step >= last_step:
            return None  # the last step: the run ends, and no fault can need this snapshot
        if not snaps.started:
            if (step % 5 == 0 or checkpoint_due) and self._fit():  # past the first, slow steps
                snaps.take(step)
        elif snaps.every is None:
            if snaps.rounds < 2:
                snaps.take(step)  # a second round, timed with its buffers warm
            else:
                self._agree_interval(step_seconds or 0.0, checkpoint_every)
                if checkpoint_due:
                    snaps.take(step)
        elif snaps.due(step) or checkpoint_due:
            snaps.take(step)
        return snaps.image(step) if checkpoint_due else None

    def _agree_interval(self, step_seconds: float, checkpoint_every: int | None) -> None:
        snaps = self.snaps
        snaps.wait()
        proposal = torch.tensor([auto_every(snaps.round_seconds or 0.0, step_seconds,
                                            cap=checkpoint_every)])
        dist.all_reduce(proposal, op=dist.ReduceOp.MAX, group=snaps.group)
        snaps.every = int(proposal.item())
        budget = self.budget()
        self.record(ev.SnapshotConfig(every=snaps.every, auto=True, replicas=snaps.replicas,
                    shard_bytes=self.shard_bytes, host_bytes=budget.total,
                    transient_bytes=budget.transient or None,
                    round_s=round(snaps.round_seconds or 0.0, 6), step_s=round(step_seconds, 6),
                    checkpoint_every=checkpoint_every))
        cap = (f", and never more than the checkpoint interval ({checkpoint_every})"
               if checkpoint_every else "")
        self.say(f"an in-memory snapshot every {snaps.every} step(s): a round takes "
                 f"{snaps.round_seconds or 0:.3f} s and a step {step_seconds:.3f} s, so at "
                 f"most 1 % of step time{cap}; {budget.describe()} of host memory per rank, "
                 "the checkpoint's copy included")

    def _fit(self) -> bool:
        """Agree (collective) that snapshots fit in every rank's host memory; if one rank's
        do not, none takes any, and each says why with the figures."""
        snaps = self.snaps
        budget = self.budget()
        need = budget.total
        why = refusal(self.shard_bytes, snaps.replicas, self.available, budget.transient)
        fits = torch.tensor([0 if why else 1])
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=snaps.group)
        if fits.item():
            if snaps.every is not None:
                self.record(ev.SnapshotConfig(every=snaps.every, auto=False,
                            replicas=snaps.replicas, shard_bytes=self.shard_bytes,
                            host_bytes=need, transient_bytes=budget.transient or None))
            return True
        why = why or "another rank's in-memory snapshots would not fit in its host memory"
        self.record(ev.SnapshotsRefused(reason=why, need_bytes=need,
                    available_bytes=self.available))
        self.say(why)
        self.refused = True
        return False
