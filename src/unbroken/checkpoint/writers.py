"""Which rank writes each replicated tensor of a save, decided the same on every rank.

A data-parallel job's plain (non-DTensor) tensors are the same on every rank, and DCP saves
each of them once, from one rank. If every rank staged them all, a node of 8 DDP ranks
would hold 8 host copies of the state to write one. Instead the ranks agree, before staging,
that they hold the same replicated tensors (`digest`, compared in the save's vote), and each
stages only those `assign` gives it: the largest first, each to the rank with the fewest
bytes so far, so the writes stay spread over the ranks as DCP's own balancing spreads them.
A rank's staged state leaves the others out, so DCP plans each of them on its writer alone;
a rollback to the staged copy first gets them back from their writers (`fill`).

Only tensors held directly in a dict are assigned (a list's element cannot be left out
without renumbering its neighbours); DTensor shards are each rank's own, and DCP dedups
replicated shards (HSDP) itself. No torch.distributed here: `fill` is given its broadcast.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

Path = tuple[Any, ...]
"""A tensor's place in a nested state dict: the keys from the root."""


@dataclass(frozen=True)
class Replicated:
    """A plain tensor held in a dict of the state: where, and its shape and dtype."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path))


def replicated(state: Any, path: Path = ()) -> Iterator[Replicated]:
    """Every plain tensor held directly in a dict of `state`, in the dicts' order."""
    if isinstance(state, dict):
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
                yield Replicated((*path, k), tuple(v.shape), v.dtype)
            elif isinstance(v, dict | list | tuple):
                yield from replicated(v, (*path, k))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            if isinstance(v, dict | list | tuple):
                yield from replicated(v, (*path, i))


def digest(items: list[Replicated]) -> int:
    """A 56-bit fingerprint of the replicated tensors' places, shapes and dtypes: equal on
    every rank exactly when they hold the same ones (fits a signed 64-bit vote)."""
    h = hashlib.blake2b(digest_size=7)
    for it in sorted(items, key=lambda it: it.name):
        h.update(f"{it.name}|{it.shape}|{it.dtype}\n".encode())
    return int.from_bytes(h.digest(), "big")


def assign(items: list[Replicated], world: int) -> dict[Path, int]:
    """Each item's writer among `world` ranks: largest first (ties by name), each to the rank
    with the fewest bytes so far (ties: the lowest rank). The same on every rank given the
    same items in any order."""
    load = [0] * world
    out: dict[Path, int] = {}
    for it in sorted(items, key=lambda it: (-it.nbytes, it.name)):
        rank = min(range(world), key=lambda r: (load[r], r))
        out[it.path] = rank
        load[rank] += it.nbytes
    return out


def fill(state: dict[Any, Any], writers: dict[Path, int], items: dict[Path, Replicated], me: int,
         broadcast: Callable[[torch.Tensor, int], None]) -> dict[Any, Any]:
    """`state` (a staged state that left out what other ranks write) made whole, in place:
    for each item in name order, `broadcast(tensor, writer)` (collective: every rank makes
    the same calls) sends the writer's tensor, which the others receive into a new host
    tensor in its place."""
    for path in sorted(writers, key=lambda p: items[p].name):
        *parents, key = path
        holder = state
        for k in parents:
            holder = holder[k]
        if writers[path] != me:
            holder[key] = torch.empty(items[path].shape, dtype=items[path].dtype)
        broadcast(holder[key], writers[path])
    return state
