"""One host copy of a rank's shards, replicated to buddies on other nodes; the copy the
storage checkpoint persists and a rollback restores.

A round, at a committed step `k` (the same steps on every rank, and every checkpoint step):

1. **Send.** Each rank sends its shards as they are now, straight from the live tensors, to
   `replicas` buddies: ranks `rank + k * local_world_size` (mod the world), a ring across
   nodes where there are several, so that a node's loss leaves a copy of each of its shards
   elsewhere. It receives each of its senders' shards into the older of that stream's two
   buffers. What a forward pass may change (buffers) was copied aside on the main thread
   first; parameters and optimizer state change only in the optimizer's update, which the
   step pre-hook holds until the round ends. Sent and received in chunks of `CHUNK` bytes;
   every receive is posted before the first chunk is sent. On GPU the chunks go through a
   ring of `RING_SLOTS` pinned chunks on a stream of their own (`chunk_ring.ChunkRing`),
   never a whole host copy of the shard.
2. **Agree.** One all-reduce (MIN) on the snapshot group: every rank received every copy
   whole. Only then is a held copy of `k` usable, and only then is a copy of an older step
   given up.
3. **Copy.** The live tensors into the rank's one own buffer (`own`): it now holds `k`,
   and the storage checkpoint of step `k` persists from it (`image`).

Why in this order: at every moment of a round each shard has a whole copy of one common
step on two ranks (its own rank, live or in `own`, and its buddy), so the loss of any one
rank leaves every shard recoverable. Copying `own` before the exchange would overwrite the
rank's only local copy of `k - K` while its buddy, which holds the other, may die mid-send.
The cost: the exchange must end within the step that follows (the update waits for it);
it is not spread over the steps between rounds (docs/design-notes.md says why).

Host memory per rank: one own buffer and two per buddy, `(1 + 2 * replicas) * shard`, and on
GPU the ring's `RING_SLOTS * CHUNK` bytes (`host_copy.HostBudget`); the storage checkpoint
adds nothing (it persists from `own`, pinned on GPU: exact size, `HostBuffer`). A buffer is marked with its step
only once it is whole; a half-received one is never reported (`holdings`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from unbroken.checkpoint.host_buffer import separate
from unbroken.runtime.generations.state_sync import byte_view
from unbroken.runtime.sharded.chunk_ring import ChunkRing
from unbroken.runtime.sharded.host_copy import (
    CHUNK,
    RING_SLOTS,
    Copy,
    Layout,
    buddies,
    chunks,
    writable,
)
from unbroken.runtime.sharded.shards import LocalShards

LEASE_TIMEOUT = 120.0
"""Seconds a round waits for the checkpoint writer to let go of `own` before it gives up
its own copy (the round then fails; the previous copy stays in force)."""


class RoundImage:
    """The storage checkpoint's view of one round's own copy (`checkpoint.staging.HostImage`):
    a typed view of `own` for each live tensor of the shards. The writer holds a lease on
    `own` until `release`: a later round's copy into `own` waits for it."""

    def __init__(self, step: int, views: dict[int, torch.Tensor], copied: threading.Event,
                 snaps: PeerSnapshots) -> None:
        self.step, self._views, self._copied, self._snaps = step, views, copied, snaps
        self.released = threading.Event()

    def view_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The copy of live tensor `t` (a local shard), or None if `t` is not in the shards."""
        view = self._views.get(t.data_ptr()) if t.numel() else None
        if view is None or view.shape != t.shape or view.dtype != t.dtype:
            return None
        return view

    def wait(self) -> str | None:
        """Until the round has copied its step into `own`; why it could not, or None."""
        self._copied.wait()
        if self._snaps.own.step != self.step:
            return self._snaps.failed or f"the round of step {self.step} did not copy"
        return None

    def release(self) -> None:
        """The writer is done with `own` (idempotent)."""
        self.released.set()


class PeerSnapshots:
    """A rank's one host copy of its shards, and its buddies' copies. Main thread: `take`,
    `wait`, `image`, `holdings`, `find`, `restore`, `rollback` (between steps, or in a
    switch with no round running)."""

    def __init__(self, shards: LocalShards, replicas: int, every: int | None,
                 record: Callable[..., None]) -> None:
        self.shards, self.replicas, self.every = shards, replicas, every
        self.configured = every  # None: the ranks agree on one after the first rounds
        self.started = False  # the first round is taken (so the ranks agreed it fits)
        self.rounds = 0  # rounds started since (re)starting the schedule
        self.record = record
        self.own = Copy()
        self.held: dict[int, list[Copy]] = {}  # the sending rank -> its two buffers
        self._early: dict[int, torch.Tensor] = {}  # forward-mutable tensors, set aside
        self._group: dist.ProcessGroup | None = None
        self._send: list[int] = []
        self._recv: list[int] = []
        self._shard_of: Callable[[int], int] = shards.shard_index
        self._rank = 0  # the rank (so the shard index) this process holds state for
        self._thread: threading.Thread | None = None
        self._copied = threading.Event()  # the current round's: set when it has ended
        self._copied.set()
        self._readers: list[threading.Event] = []  # images not yet released by their writer
        self.failed: str | None = None  # why the last round failed, if it did
        self.round_seconds: float | None = None  # the last whole round's exchange and copy
        self.last_step = -1  # the step of the last round started
        self.stalls = 0.0  # seconds the loop waited for rounds
        self.fault_point: Callable[[str, int], None] = lambda point, step: None
        """Injected faults (tests): called with ("sent", step) after each chunk sent."""
        self.ring = ChunkRing(RING_SLOTS, CHUNK)
        """The exchange's staging of device bytes (GPU shards only)."""
        self._ready: Any = None  # GPU: an event where the main stream stood at `take`
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
        return (self._group is not None and self.every is not None
                and step - self.last_step >= self.every)

    def take(self, step: int) -> None:
        """Start a round for committed step `step` (the same steps on every rank), between
        steps. Waits for the previous round first, so that rounds pair up across ranks."""
        t0 = time.monotonic()
        self.wait()
        tensors = self.shards.tensors()  # now: inside a forward FSDP2 swaps parameters
        layout = Layout.of(tensors)
        meta, rng = self.shards.meta(), torch.get_rng_state()
        self._readers = [r for r in self._readers if not r.is_set()]
        readers = list(self._readers)  # earlier rounds' images: this copy waits for them
        sources: list[torch.Tensor] | None = None
        failed = None
        try:
            on_gpu = any(t.is_cuda for t in tensors)
            if self.own.layout != layout:
                self.own.fit(layout, pin=on_gpu)
            sources = self._sources(tensors)
            if on_gpu:
                self._ready = torch.cuda.Event()
                self._ready.record()  # the last update's kernels: the copies wait for them
        except Exception as exc:  # out of host memory, say: this round carries no copy
            failed = f"the copy failed: {type(exc).__name__}: {exc}".splitlines()[0]
        self.stalls += time.monotonic() - t0
        self.last_step, self.started = step, True
        self.rounds += 1
        self._copied = copied = threading.Event()
        self._thread = threading.Thread(
            target=self._round,
            args=(step, layout, sources, meta, rng, copied, readers, failed),
            name="unbroken-snapshot", daemon=True)
        self._thread.start()

    def _sources(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """What the round sends and copies, as bytes: parameters and optimizer state live
        (only the update changes them, and it waits for the round); what a forward may
        change, copied aside now."""
        late = self.shards.deferrable(len(tensors))
        out = []
        for i, (t, defer) in enumerate(zip(tensors, late, strict=True)):
            if defer and t.is_contiguous():
                out.append(byte_view(t))
                continue
            aside = self._early.get(i)
            if aside is None or aside.shape != t.shape or aside.dtype != t.dtype:
                aside = self._early[i] = torch.empty(t.shape, dtype=t.dtype)
            aside.copy_(t)
            out.append(byte_view(aside))
        return out

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

    def _round(self, step: int, layout: Layout, sources: list[torch.Tensor] | None,
               meta: dict[str, Any], rng: torch.Tensor, copied: threading.Event,
               readers: list[threading.Event], failed: str | None) -> None:
        t0 = time.monotonic()
        try:
            try:
                self._exchange(step, sources, layout, meta)
            except Exception as exc:  # a buddy died or the generation was aborted
                failed = failed or _why(exc)
            try:
                if not self._agree(failed is None):
                    failed = failed or "another rank's round failed"
            except Exception as exc:
                failed = failed or _why(exc)
            if failed is None:
                failed = self._copy_own(step, sources, meta, rng, readers)
        except Exception as exc:
            failed = failed or f"the copy failed: {_why(exc)}"
        finally:
            self.failed = failed
            copied.set()
        if failed is None:
            self.round_seconds = time.monotonic() - t0

    def _copy_own(self, step: int, sources: list[torch.Tensor], meta: dict[str, Any],
                  rng: torch.Tensor, readers: list[threading.Event]) -> str | None:
        """Every rank holds every copy of `step` whole: now `own` may give up its step, once
        the writers of earlier checkpoints no longer read it."""
        deadline = time.monotonic() + LEASE_TIMEOUT
        if not all(r.wait(max(0.0, deadline - time.monotonic())) for r in readers):
            return (f"the checkpoint writer still read the copy of step {self.own.step} after "
                    f"{LEASE_TIMEOUT:.0f} s")
        own = self.own
        own.step = -1
        self.ring.copy(list(zip(own.views(), sources, strict=True)), self._ready)
        own.meta, own.rng, own.step = meta, rng, step
        return None

    def _agree(self, ok: bool) -> bool:
        """Every rank's exchange was whole (collective over the snapshot group)."""
        if self._group is None or not (self._send or self._recv):
            return ok
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _exchange(self, step: int, sources: list[torch.Tensor] | None, layout: Layout,
                  meta: dict[str, Any]) -> None:
        """Send ours to each buddy while receiving each of theirs: our header first, then
        every sender's header received and every receive of its chunks posted, then our
        chunks (through the pinned ring on GPU). A rank waits on its own sends only once all
        of its receives are posted, so the ring of buddies cannot deadlock however small the
        chunk ring. `sources` None: our copy failed; the header says so."""
        group = self._group
        if group is None or not (self._send or self._recv):
            return
        if sources is None:
            header = [torch.tensor([-1, 0, 0, 0], dtype=torch.int64)]
        else:
            blob = json.dumps(meta).encode()
            header = [torch.tensor([step, len(blob), len(layout.sizes), layout.total],
                                   dtype=torch.int64),
                      torch.tensor(layout.sizes, dtype=torch.int64),
                      torch.frombuffer(bytearray(blob), dtype=torch.uint8)]
        sends = [dist.isend(t, dst=dst, group=group, tag=k)
                 for k, t in enumerate(header) for dst in self._send]
        incoming = self._post_receives(step, group)
        if sources is not None:
            def post(piece: torch.Tensor, i: int) -> list[Any]:
                works = [dist.isend(piece, dst=dst, group=group, tag=3 + i) for dst in self._send]
                self.fault_point("sent", step)
                return works

            if any(src.is_cuda for src in sources):
                sends += self.ring.send(chunks(sources), post, self._ready)
            else:  # host memory already: sent from where it lies
                sends += [w for i, piece in enumerate(chunks(sources)) for w in post(piece, i)]
        for w in sends:
            w.wait()
        for target, meta_buf, works in incoming:
            for w in works:
                w.wait()
            target.meta = json.loads(bytes(meta_buf.numpy()).decode())
            target.step = step  # whole: only now usable (the agreement follows)

    def _post_receives(self, step: int, group: dist.ProcessGroup,
                       ) -> list[tuple[Copy, torch.Tensor, list[Any]]]:
        """Each sender's header, then every receive of its round posted: (the buffer it
        fills, its meta's buffer, the receives' works). Senders that say their copy failed
        send nothing more."""
        heads = {src: torch.zeros(4, dtype=torch.int64) for src in self._recv}
        head_work = {src: dist.irecv(heads[src], src=src, group=group, tag=0)
                     for src in self._recv}
        incoming = []
        for src in self._recv:
            head_work[src].wait()
            sent_step, meta_len, count, total = (int(v) for v in heads[src])
            if sent_step == -1:
                continue  # its copy failed: nothing more comes from it this round
            if sent_step != step:
                raise RuntimeError(f"rank {src} sent the snapshot of step {sent_step} in the "
                                   f"round of step {step}")
            sizes = torch.zeros(count, dtype=torch.int64)
            dist.irecv(sizes, src=src, group=group, tag=1).wait()
            theirs = Layout.of_sizes(sizes.tolist())
            if theirs.total != total:
                raise RuntimeError(f"rank {src} sent a header that does not add up")
            target = writable(self.held.setdefault(src, [Copy(), Copy()]))
            target.step = -1
            target.fit(theirs)
            meta_buf = torch.empty(meta_len, dtype=torch.uint8)
            works = [dist.irecv(meta_buf, src=src, group=group, tag=2)]
            works += [dist.irecv(p, src=src, group=group, tag=3 + i)
                      for i, p in enumerate(chunks(target.views()))]
            incoming.append((target, meta_buf, works))
        return incoming

    def transient_bytes(self) -> int:
        """A round's host memory beyond the copies: the ring's chunks, on GPU only."""
        return self.ring.host_bytes if any(t.is_cuda for t in self.shards.tensors()) else 0

    # ------------------------------------------------------------ the checkpoint's view
    def image(self, step: int) -> RoundImage | None:
        """The round of `step`'s own copy, for the storage checkpoint of that step to persist
        from (taking the writer's lease on `own`); None if no round was taken at `step`."""
        if self.last_step != step or self.own.layout is None:
            return None
        views = {}
        # Storages of their own (aliasing `own`): DCP clones a view of a larger buffer.
        for t, raw in zip(self.shards.tensors(), separate(self.own.buf, self.own.layout),
                          strict=True):
            if t.numel():
                views[t.data_ptr()] = raw.view(t.dtype).view(t.shape)
        image = RoundImage(step, views, self._copied, self)
        self._readers.append(image.released)
        return image

    # ------------------------------------------------------------ recovery
    def holdings(self) -> list[tuple[int, int]]:
        """(shard index, step) of every whole snapshot this rank holds."""
        mine = self._shard_of(self._rank)
        out = [(mine, self.own.step)] if self.own.step >= 0 else []
        for src, pair in self.held.items():
            out += [(self._shard_of(src), c.step) for c in pair if c.step >= 0]
        return out

    def find(self, shard: int, step: int) -> Copy:
        """A whole snapshot of `shard` at `step` that this rank holds."""
        copies = [self.own] if shard == self._shard_of(self._rank) else []
        copies += [c for src, pair in self.held.items() if self._shard_of(src) == shard
                   for c in pair]
        for c in copies:
            if c.step == step:
                return c
        raise KeyError(f"no snapshot of shard {shard} at step {step}")

    def restore(self, step: int) -> None:
        """Load our own snapshot of `step` into the live state."""
        copy = self.find(self._shard_of(self._rank), step)
        self.shards.load(copy.buf, copy.layout)
        self.shards.load_meta(copy.meta)

    def rollback(self) -> int | None:
        """Load `own` back into the live state, RNG included, if every rank's own copy is of
        one step (collective over the snapshot group, between steps); that step, or None
        (and nothing changes)."""
        self.wait()
        if self._group is None:
            return None
        s = self.own.step
        bounds = torch.tensor([s, -s], dtype=torch.int64)
        dist.all_reduce(bounds, op=dist.ReduceOp.MIN, group=self._group)
        low, high = int(bounds[0]), -int(bounds[1])
        if low < 0 or low != high:
            return None
        self.restore(low)
        torch.set_rng_state(self.own.rng)
        self.forget_after(low)
        return low

    def restart_rounds(self) -> None:
        """Back to before the first round (the ranks disagree on where they stand: a joiner
        arrived before the interval was agreed); whole snapshots held stay usable."""
        self.every, self.started, self.last_step = self.configured, False, -1
        self.rounds = 0

    def adopt(self, every: int, step: int) -> None:
        """Take the interval the others agreed, counting from `step`: rounds stay in step."""
        self.every, self.started, self.last_step = every, True, step

    def forget_after(self, step: int) -> None:
        """After a rollback to `step`: snapshots of later steps belong to a timeline that no
        longer exists, and must never be mixed with the replayed one."""
        for c in [self.own, *(c for pair in self.held.values() for c in pair)]:
            if c.step > step:
                c.step = -1
        self.last_step = min(self.last_step, step)


def _why(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
