"""The host copies of a rank's shards: where each tensor lies in a flat host buffer
(`Layout`), one buffer (`Copy`), and how much memory and how often (`host_bytes`,
`refusal`, `auto_every`, `buddies`). Pure, apart from the buffers themselves; the rounds that
fill them are `snapshots.PeerSnapshots`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 64
"""Each tensor starts at a multiple of this many bytes in a host buffer: any dtype's view of
it is aligned, so a restore or a checkpoint reads it in place."""

CHUNK = 4 << 20
"""Bytes per message of a round's exchange."""

@dataclass(frozen=True)
class Layout:
    """Where each tensor of a shard list lies in one flat host buffer: `ALIGN`-aligned."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int

    @classmethod
    def of_sizes(cls, sizes: list[int] | tuple[int, ...]) -> Layout:
        offsets, pos = [], 0
        for n in sizes:
            offsets.append(pos)
            pos += -(-n // ALIGN) * ALIGN
        return cls(tuple(sizes), tuple(offsets), pos)

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> Layout:
        return cls.of_sizes([t.numel() * t.element_size() for t in tensors])

    def slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The byte view of each tensor's place in `flat`."""
        return [flat[o:o + n] for o, n in zip(self.offsets, self.sizes, strict=True)]


def chunks(views: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The non-empty pieces of at most `CHUNK` bytes that a round sends, in order."""
    for v in views:
        for pos in range(0, v.numel(), CHUNK):
            yield v[pos:pos + CHUNK]


@dataclass
class Copy:
    """One host buffer: whole (and usable) only when `step >= 0`."""

    buf: torch.Tensor | None = None
    layout: Layout | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    rng: torch.Tensor | None = None  # own copy only: the CPU RNG state at its step
    step: int = -1

    def views(self) -> list[torch.Tensor]:
        """Each tensor's bytes, in the shard list's order."""
        return self.layout.slices(self.buf)

    def fit(self, layout: Layout) -> None:
        """Make the buffer `layout.total` bytes (touched, so a round is timed warm)."""
        if self.buf is None or self.buf.numel() != layout.total:
            self.buf, self.step = None, -1
            self.buf = torch.zeros(layout.total, dtype=torch.uint8)
        self.layout = layout


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


def host_bytes(nbytes: int, replicas: int) -> int:
    """Host memory a rank needs for every copy: its own buffer (which the storage checkpoint
    also persists from) and two buffers for each buddy's shards."""
    return nbytes * (1 + 2 * replicas)


def refusal(shard_bytes: int, replicas: int, available: int) -> str | None:
    """Why snapshots of `shard_bytes` with `replicas` buddies would not fit in `available`
    bytes of host memory per rank (at most 80 % of it is used), with the figures; or None."""
    need = host_bytes(shard_bytes, replicas)
    if need <= 0.8 * available:
        return None
    return (f"in-memory snapshots need {need / 2**20:.0f} MiB of host memory per rank ((1 + 2 "
            f"x {replicas} replica(s)) x {shard_bytes / 2**20:.0f} MiB) and "
            f"{available / 2**20:.0f} MiB is available per rank: a fault that loses a shard "
            "with no live replica restarts from the storage checkpoint")


def auto_every(round_seconds: float, step_seconds: float, budget: float = 0.01,
               cap: int | None = None) -> int:
    """Snapshot interval (steps) that keeps a round's cost within `budget` of step time,
    and never longer than `cap` (the checkpoint interval: a restart from storage must never
    redo fewer steps than an in-place recovery)."""
    every = 1 if step_seconds <= 0 else max(1, math.ceil(round_seconds / (budget * step_seconds)))
    return every if cap is None else max(1, min(every, cap))
