"""In-memory snapshots of a rank's shards, replicated to buddies on other nodes.

Every `every` committed steps each rank copies its shards (`LocalShards`) into a host
buffer and sends the copy to `replicas` buddies: ranks `rank + k * local_world_size` (mod
the world), a ring across nodes where there are several, so that a node's loss leaves a
copy of each of its shards elsewhere. The list of tensors is taken, and the buffers (which
a forward pass may change) copied, on the main thread between steps; parameters and
optimizer state are copied by a thread of its own, which then exchanges the copies over a
gloo group of their own. The optimizer's step pre-hook holds the next update until that
copy is done; with the wait for the previous round, that is the loop's only wait.

Two buffers per stream (our own, and each buddy's): a round fills the older one, so the
newest complete snapshot is never overwritten; a buffer is marked with its step only once
it is whole, and a half-received one is never reported (`holdings`). Rounds start at the
same committed steps on every rank (the main thread decides, and waits for the previous
round to end first), and a rank whose copy failed still sends a header saying so, so the
exchanges always pair up; a received header for another step fails the round.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from unbroken.runtime.shards import LocalShards
from unbroken.telemetry import schema as ev


@dataclass
class Copy:
    """One snapshot buffer: whole (and usable) only when `step >= 0`."""

    buf: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    step: int = -1


def _pair() -> list[Copy]:
    return [Copy(), Copy()]


def _allocate(pair: list[Copy], nbytes: int) -> None:
    """Both buffers of a stream at once, touched (so the second round is timed warm)."""
    for c in pair:
        if c.buf is None or c.buf.numel() != nbytes:
            c.buf, c.step = torch.zeros(nbytes, dtype=torch.uint8), -1


def _writable(pair: list[Copy]) -> Copy:
    """The buffer a new round may fill: never the newest whole one."""
    return min(pair, key=lambda c: c.step)


def buddies(rank: int, world: int, local_world: int, replicas: int) -> tuple[list[int], list[int]]:
    """(ranks we send our snapshot to, ranks we receive one from): a ring across nodes."""
    stride = local_world if world > local_world else 1
    send = [(rank + k * stride) % world for k in range(1, replicas + 1)]
    recv = [(rank - k * stride) % world for k in range(1, replicas + 1)]
    send = [r for r in dict.fromkeys(send) if r != rank]
    recv = [r for r in dict.fromkeys(recv) if r != rank]
    return send, recv


def host_bytes(nbytes: int, replicas: int) -> int:
    """Host memory a rank needs: two buffers for its own shards and for each buddy's."""
    return 2 * nbytes * (1 + replicas)


def refusal(shard_bytes: int, replicas: int, available: int) -> str | None:
    """Why snapshots of `shard_bytes` with `replicas` buddies would not fit in `available`
    bytes of host memory per rank (at most 80 % of it is used), with the figures; or None."""
    need = host_bytes(shard_bytes, replicas)
    if need <= 0.8 * available:
        return None
    return (f"in-memory snapshots need {need / 2**20:.0f} MiB of host memory per rank (2 x "
            f"{shard_bytes / 2**20:.0f} MiB x (1 + {replicas} replica(s))) and "
            f"{available / 2**20:.0f} MiB is available per rank: a fault that loses a shard "
            "with no live replica restarts from the storage checkpoint")


def auto_every(round_seconds: float, step_seconds: float, budget: float = 0.01) -> int:
    """Snapshot interval (steps) that keeps a round's cost within `budget` of step time."""
    if step_seconds <= 0:
        return 1
    return max(1, math.ceil(round_seconds / (budget * step_seconds)))


class PeerSnapshots:
    """A rank's in-memory snapshots and its buddies'. Main thread: `take`, `wait`,
    `holdings`, `find`, `restore` (between steps, or in a switch with no round running)."""

    def __init__(self, shards: LocalShards, replicas: int, every: int | None,
                 record: Callable[..., None]) -> None:
        self.shards, self.replicas, self.every = shards, replicas, every
        self.configured = every  # None: the ranks agree on one after the first rounds
        self.started = False  # the first round is taken (so the ranks agreed it fits)
        self.rounds = 0  # rounds started since (re)starting the schedule
        self.record = record
        self.own = _pair()
        self.held: dict[int, list[Copy]] = {}  # the sending rank -> its two buffers
        self._group: dist.ProcessGroup | None = None
        self._send: list[int] = []
        self._recv: list[int] = []
        self._shard_of: Callable[[int], int] = shards.shard_index
        self._rank = 0  # the rank (so the shard index) this process holds state for
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()
        self._copied.set()
        self.failed: str | None = None  # why the last round failed, if it did
        self.round_seconds: float | None = None  # the last whole round's copy and exchange
        self.last_step = -1  # the step of the last round started
        self.stalls = 0.0  # seconds the loop waited for copies or rounds
        for opt in shards.optimizers:
            opt.register_step_pre_hook(lambda *_: self._wait_copied())

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    # ------------------------------------------------------------ per generation
    def use_group(self, group: dist.ProcessGroup, rank: int, world: int,
                  local_world: int) -> None:
        """Replicate over `group` (gloo, formed in the new generation) from now on."""
        self.wait()
        self._group, self._rank = group, rank
        self._send, self._recv = buddies(rank, world, local_world, self.replicas)
        self.failed = None

    # ------------------------------------------------------------ rounds
    def due(self, step: int) -> bool:
        return (self._group is not None and self.every is not None and step > self.last_step
                and step % self.every == 0)

    def take(self, step: int) -> None:
        """Start a round for committed step `step` (the same steps on every rank), between
        steps. Waits for the previous round first, so that rounds pair up across ranks."""
        t0 = time.monotonic()
        self.wait()
        tensors = self.shards.tensors()  # now: inside a forward FSDP2 swaps parameters
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        target = _writable(self.own)
        target.step, target.meta = -1, self.shards.meta()
        late, copied = [], None
        try:
            _allocate(self.own, nbytes)
            # What a forward may change (buffers) now; what only the optimizer changes,
            # on the thread, before the next update (the pre-hook waits for it).
            late = copy_tensors(tensors, target.buf, self.shards.deferrable(len(tensors)))
        except Exception as exc:  # out of host memory, say: this round carries no snapshot
            copied = f"the copy failed: {type(exc).__name__}: {exc}".splitlines()[0]
        self.stalls += time.monotonic() - t0
        self.last_step, self.started = step, True
        self.rounds += 1
        self._copied.clear()
        self._thread = threading.Thread(target=self._round, args=(step, target, late, copied),
                                        name="unbroken-snapshot", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the current round (if any) has ended, whole or failed; False if `timeout`
        passed first (the round's exchange is bounded by its group's timeout)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def _wait_copied(self) -> None:
        if not self._copied.is_set():
            t0 = time.monotonic()
            self._copied.wait()
            self.stalls += time.monotonic() - t0

    def _round(self, step: int, target: Copy,
               late: list[tuple[torch.Tensor, torch.Tensor]], failed: str | None) -> None:
        t0 = time.monotonic()
        try:
            if failed is None:
                for src, dst in late:
                    dst.copy_(src)
                target.step = step
        except Exception as exc:
            failed = f"the copy failed: {type(exc).__name__}: {exc}".splitlines()[0]
        finally:
            self._copied.set()
        try:
            self._exchange(step, None if failed else target)
        except Exception as exc:  # a buddy died or the generation was aborted: no harm done
            failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.failed = failed
        if failed is None:
            self.round_seconds = time.monotonic() - t0

    def _exchange(self, step: int, mine: Copy | None) -> None:
        """Send ours to each buddy while receiving each of theirs (non-blocking both ways,
        so the ring cannot deadlock). `mine` None: our copy failed; the header says so."""
        group = self._group
        if mine is None:
            outgoing = [torch.tensor([-1, 0, 0], dtype=torch.int64)]
        else:
            meta = json.dumps(mine.meta).encode()
            outgoing = [torch.tensor([step, len(meta), mine.buf.numel()], dtype=torch.int64),
                        torch.frombuffer(bytearray(meta), dtype=torch.uint8), mine.buf]
        sends = [dist.isend(t, dst=dst, group=group, tag=k)
                 for dst in self._send for k, t in enumerate(outgoing)]
        heads = {src: torch.zeros(3, dtype=torch.int64) for src in self._recv}
        head_work = {src: dist.irecv(heads[src], src=src, group=group, tag=0)
                     for src in self._recv}
        incoming = []
        for src in self._recv:
            head_work[src].wait()
            sent_step, meta_len, nbytes = (int(v) for v in heads[src])
            if sent_step == -1:
                continue  # its copy failed: nothing more comes from it this round
            if sent_step != step:
                raise RuntimeError(f"rank {src} sent the snapshot of step {sent_step} in the "
                                   f"round of step {step}")
            pair = self.held.setdefault(src, _pair())
            _allocate(pair, nbytes)
            target = _writable(pair)
            target.step = -1
            meta_buf = torch.empty(meta_len, dtype=torch.uint8)
            incoming.append((target, meta_buf,
                             dist.irecv(meta_buf, src=src, group=group, tag=1),
                             dist.irecv(target.buf, src=src, group=group, tag=2)))
        for w in sends:
            w.wait()
        for target, meta_buf, w_meta, w_buf in incoming:
            w_meta.wait()
            w_buf.wait()
            target.meta = json.loads(bytes(meta_buf.numpy()).decode())
            target.step = step  # whole: only now usable

    # ------------------------------------------------------------ recovery
    def holdings(self) -> list[tuple[int, int]]:
        """(shard index, step) of every whole snapshot this rank holds."""
        mine = self._shard_of(self._rank)
        out = [(mine, c.step) for c in self.own if c.step >= 0]
        for src, pair in self.held.items():
            out += [(self._shard_of(src), c.step) for c in pair if c.step >= 0]
        return out

    def find(self, shard: int, step: int) -> Copy:
        """A whole snapshot of `shard` at `step` that this rank holds."""
        pairs = [self.own] if shard == self._shard_of(self._rank) else []
        pairs += [pair for src, pair in self.held.items() if self._shard_of(src) == shard]
        for pair in pairs:
            for c in pair:
                if c.step == step:
                    return c
        raise KeyError(f"no snapshot of shard {shard} at step {step}")

    def restore(self, step: int) -> None:
        """Load our own snapshot of `step` into the live state."""
        copy = self.find(self._shard_of(self._rank), step)
        self.shards.load(copy.buf)
        self.shards.load_meta(copy.meta)

    def restart_rounds(self) -> None:
        """Back to before the first round (the ranks disagree on where they stand: a joiner
        arrived before the interval was agreed); whole snapshots held stay usable."""
        self.every, self.started, self.last_step = self.configured, False, -1
        self.rounds = 0

    def adopt(self, every: int, step: int) -> None:
        """Take the interval the others agreed, resuming at `step`: rounds stay in step."""
        self.every, self.started = every, True
        self.last_step = step if self.last_step < 0 else min(self.last_step, step)

    def forget_after(self, step: int) -> None:
        """After a rollback to `step`: snapshots of later steps belong to a timeline that no
        longer exists, and must never be mixed with the replayed one."""
        for pair in [self.own, *self.held.values()]:
            for c in pair:
                if c.step > step:
                    c.step = -1
        self.last_step = min(self.last_step, step)


def copy_tensors(tensors: list[torch.Tensor], flat: torch.Tensor,
                 late: list[bool]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy `tensors`, back to back, into the flat byte buffer: now, except those `late`
    marks to defer; returns the deferred (source, destination) pairs."""
    deferred, pos = [], 0
    for t, defer in zip(tensors, late, strict=True):
        n = t.numel() * t.element_size()
        src = t.contiguous().view(-1).view(torch.uint8)
        if defer:
            deferred.append((src, flat[pos:pos + n]))
        else:
            flat[pos:pos + n].copy_(src)
        pos += n
    return deferred


class SnapshotPacer:
    """When to take a round: the snapshot interval policy, decided the same on every rank.

    Before the first round the ranks agree (collective) that snapshots fit in every rank's
    host memory; with `every=None` the first two rounds are timed and the ranks then agree
    on the interval (the largest proposal), so that rounds pair up."""

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

    def after_commit(self, step: int, last_step: int, step_seconds: float | None) -> None:
        """After committed step `step` (the next to run) of a run to `last_step`: start a
        round if one is due (collective when it decides)."""
        snaps = self.snaps
        if self.refused or step >= last_step:
            return  # the last step: the run ends, and no fault can need this snapshot
        if not snaps.started:
            if step % 5 == 0 and self._fit():  # past the first, slow steps
                snaps.take(step)
            return
        if snaps.every is None:
            if snaps.rounds < 2:
                snaps.take(step)  # a second round, timed with its buffers warm
                return
            self._agree_interval(step_seconds or 0.0)
        elif snaps.due(step):
            snaps.take(step)

    def _agree_interval(self, step_seconds: float) -> None:
        snaps = self.snaps
        snaps.wait()
        proposal = torch.tensor([auto_every(snaps.round_seconds or 0.0, step_seconds)])
        dist.all_reduce(proposal, op=dist.ReduceOp.MAX, group=snaps.group)
        snaps.every = int(proposal.item())
        host = host_bytes(self.shard_bytes, snaps.replicas)
        self.record(ev.SnapshotConfig(every=snaps.every, auto=True, replicas=snaps.replicas,
                    shard_bytes=self.shard_bytes, host_bytes=host,
                    round_s=round(snaps.round_seconds or 0.0, 6), step_s=round(step_seconds, 6)))
        self.say(f"an in-memory snapshot every {snaps.every} step(s): a round takes "
                 f"{snaps.round_seconds or 0:.3f} s and a step {step_seconds:.3f} s, so at "
                 f"most 1 % of step time; {host / 2**20:.0f} MiB of host memory per rank")

    def _fit(self) -> bool:
        """Agree (collective) that snapshots fit in every rank's host memory; if one rank's
        do not, none takes any, and each says why with the figures."""
        snaps = self.snaps
        need = host_bytes(self.shard_bytes, snaps.replicas)
        why = refusal(self.shard_bytes, snaps.replicas, self.available)
        fits = torch.tensor([0 if why else 1])
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=snaps.group)
        if fits.item():
            if snaps.every is not None:
                self.record(ev.SnapshotConfig(every=snaps.every, auto=False,
                            replicas=snaps.replicas, shard_bytes=self.shard_bytes,
                            host_bytes=need))
            return True
        why = why or "another rank's in-memory snapshots would not fit in its host memory"
        self.record(ev.SnapshotsRefused(reason=why, need_bytes=need,
                    available_bytes=self.available))
        self.say(why)
        self.refused = True
        return False
