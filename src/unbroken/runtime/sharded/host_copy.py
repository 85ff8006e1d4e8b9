"""The host copies of a rank's shards: one buffer (`Copy`, laid out by
`checkpoint.host_buffer.Layout`), and how much memory and how often (`HostBudget`,
`host_bytes`, `refusal`, `auto_every`, `buddies`). Pure, apart from the buffers themselves;
the rounds that fill them are `snapshots.PeerSnapshots`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from unbroken.checkpoint import host_buffer
from unbroken.checkpoint.host_buffer import Layout

CHUNK = 4 << 20
"""Bytes per message of a round's exchange."""

RING_SLOTS = 4
"""Pinned chunks of `CHUNK` bytes that a GPU rank's exchange stages its sends through
(`chunk_ring.ChunkRing`): the round's transient host memory, at most."""


def chunks(views: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The non-empty pieces of at most `CHUNK` bytes that a round sends, in order."""
    return host_buffer.chunks(views, CHUNK)


@dataclass
class Copy:
    """One host buffer: whole (and usable) only when `step >= 0`."""

    buf: torch.Tensor | None = None
    layout: Layout | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    rng: torch.Tensor | None = None  # own copy only: the CPU RNG state at its step
    step: int = -1
    host: host_buffer.HostBuffer | None = None  # the allocation `buf` is

    def views(self) -> list[torch.Tensor]:
        """Each tensor's bytes, in the shard list's order."""
        return self.layout.slices(self.buf)

    def fit(self, layout: Layout, pin: bool = False) -> None:
        """Make the buffer exactly `layout.total` bytes (touched, so a round is timed warm),
        pinned when `pin` (a GPU rank's own copy, which device copies fill and drain)."""
        if self.buf is None or self.buf.numel() != layout.total:
            self.release()
            self.host = host_buffer.HostBuffer(layout.total, pin=pin)
            self.buf = self.host.tensor
            self.buf.zero_()
        self.layout = layout

    def release(self) -> None:
        """Give the buffer up (unregistered if it was pinned)."""
        if self.host is not None:
            self.host.close()
        self.buf, self.host, self.step = None, None, -1


def writable(pair: list[Copy]) -> Copy:
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


@dataclass(frozen=True)
class HostBudget:
    """The host memory one rank's snapshots take, by part (bytes). Pure arithmetic."""

    shard: int
    """The rank's shards (parameters, optimizer state, buffers)."""
    replicas: int
    """Buddies each shard is copied to."""
    transient: int = 0
    """A round's exchange staging on GPU (the pinned chunk ring); 0 on CPU, where the
    shards are sent from where they lie."""

    @property
    def copies(self) -> int:
        """Its own copy (which the storage checkpoint also persists from) and two buffers
        for each buddy's shards."""
        return self.shard * (1 + 2 * self.replicas)

    @property
    def total(self) -> int:
        return self.copies + self.transient

    def describe(self) -> str:
        """The figures, for a line: `X MiB ((1 + 2 x r replica(s)) x S MiB[ + T MiB ...])`."""
        ring = (f" + {self.transient / 2**20:.0f} MiB pinned for the exchange"
                if self.transient else "")
        return (f"{self.total / 2**20:.0f} MiB ((1 + 2 x {self.replicas} replica(s)) x "
                f"{self.shard / 2**20:.0f} MiB{ring})")


def host_bytes(nbytes: int, replicas: int, transient: int = 0) -> int:
    """Host memory a rank needs for every copy: its own buffer (which the storage checkpoint
    also persists from), two buffers for each buddy's shards, and the exchange's transient
    staging (`transient`, GPU only)."""
    return HostBudget(nbytes, replicas, transient).total


def refusal(shard_bytes: int, replicas: int, available: int, transient: int = 0) -> str | None:
    """Why snapshots of `shard_bytes` with `replicas` buddies (and `transient` bytes of
    exchange staging) would not fit in `available` bytes of host memory per rank (at most
    80 % of it is used), with the figures; or None."""
    budget = HostBudget(shard_bytes, replicas, transient)
    if budget.total <= 0.8 * available:
        return None
    return (f"in-memory snapshots need {budget.describe()} of host memory per rank and "
            f"{available / 2**20:.0f} MiB is available per rank: a fault that loses a shard "
            "with no live replica restarts from the storage checkpoint")


def auto_every(round_seconds: float, step_seconds: float, budget: float = 0.01,
               cap: int | None = None) -> int:
    """Snapshot interval (steps) that keeps a round's cost within `budget` of step time,
    and never longer than `cap` (the checkpoint interval: a restart from storage must never
    redo fewer steps than an in-place recovery)."""
    every = 1 if step_seconds <= 0 else max(1, math.ceil(round_seconds / (budget * step_seconds)))
    return every if cap is None else max(1, min(every, cap))
