"""State from peers: after a switch, ranks that lack the newest committed state get it from
a rank that holds it, over the new group. No storage involved.

Ranks publish (committed step, holds state); the highest step held is the truth. Each rank that
lacks it (a survivor one step behind, a replacement that has no state) receives it from a
holder, holders taking turns so a second replacement does not wait on the first. The state
travels as one JSON header (the nesting, and the non-tensor leaves such as learning rates)
plus the bytes of every tensor, streamed in chunks of at most `CHUNK_BYTES` through one
buffer on the group's device: neither side ever holds a second full copy of the state on
the device (the receiver assembles it in host memory, then `set_state` copies it in).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class NoStateError(RuntimeError):
    """No member of the generation holds any committed state: only a checkpoint can help."""


@dataclass(frozen=True)
class SyncResult:
    step: int  # the agreed committed step everyone now holds
    source: int | None  # the rank this one received from, or None if it already held it
    received_bytes: int


_SCALARS = (int, float, str, bool, type(None))
CHUNK_BYTES = 64 << 20  # the one transfer buffer on the device, per side


def pack(state: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Split a nested state into a JSON-able skeleton and its tensors, in order."""
    tensors: list[torch.Tensor] = []

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
                raise TypeError(f"{path}: {type(obj).__name__} (sharded state) cannot be sent whole")
            tensors.append(obj.detach())
            return {"__t": len(tensors) - 1, "dtype": str(obj.dtype).removeprefix("torch."),
                    "shape": list(obj.shape)}
        if isinstance(obj, dict):
            if not all(isinstance(k, (str, int)) for k in obj):
                raise TypeError(f"{path}: dict keys must be str or int")
            return {"__d": [[k, walk(v, f"{path}.{k}")] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            kind = "__l" if isinstance(obj, list) else "__u"
            return {kind: [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, _SCALARS):
            return obj
        raise TypeError(f"{path}: {type(obj).__name__} is not a tensor, container or scalar")

    return {"root": walk(state, "state")}, tensors


def unpack(header: dict[str, Any], buffer: torch.Tensor) -> Any:
    """Rebuild the state `pack` split, with tensors viewed out of one received byte buffer."""
    offset = 0

    def walk(obj: Any) -> Any:
        nonlocal offset
        if isinstance(obj, dict):
            if "__t" in obj:
                dtype = getattr(torch, obj["dtype"])
                count = 1
                for n in obj["shape"]:
                    count *= n
                nbytes = count * torch.empty((), dtype=dtype).element_size()
                chunk = buffer[offset : offset + nbytes]
                offset += nbytes
                # Cloned first: a view to another dtype needs an aligned offset, and tensors
                # are packed back to back.
                return chunk.clone().view(dtype).reshape(obj["shape"])
            if "__d" in obj:
                return {k: walk(v) for k, v in obj["__d"]}
            if "__l" in obj:
                return [walk(v) for v in obj["__l"]]
            if "__u" in obj:
                return tuple(walk(v) for v in obj["__u"])
            raise ValueError(f"malformed state header: {sorted(obj)}")
        return obj

    return walk(header["root"])


def send_tensors(tensors: list[torch.Tensor], total: int, dst: int,
                 group: dist.ProcessGroup | None, device: torch.device,
                 chunk: int = CHUNK_BYTES) -> None:
    """Stream the tensors' bytes (`total` of them) to `dst` in chunks of `chunk` bytes."""
    if total == 0:
        return
    buf = torch.empty(min(chunk, total), dtype=torch.uint8, device=device)
    fill = 0
    for t in tensors:
        view, pos = byte_view(t), 0
        while pos < view.numel():
            n = min(buf.numel() - fill, view.numel() - pos)
            buf[fill:fill + n].copy_(view[pos:pos + n])
            fill, pos = fill + n, pos + n
            if fill == buf.numel():
                dist.send(buf, dst=dst, group=group)
                fill = 0
    if fill:
        dist.send(buf[:fill], dst=dst, group=group)


def recv_bytes(total: int, src: int, group: dist.ProcessGroup | None, device: torch.device,
               chunk: int = CHUNK_BYTES) -> torch.Tensor:
    """Receive `send_tensors`' stream into one host buffer, through one device chunk."""
    payload = torch.empty(total, dtype=torch.uint8)
    on_host = device.type == "cpu"
    buf = None if on_host else torch.empty(min(chunk, total), dtype=torch.uint8, device=device)
    pos = 0
    while pos < total:
        n = min(chunk, total - pos)
        if on_host:
            dist.recv(payload[pos:pos + n], src=src, group=group)
        else:
            dist.recv(buf[:n], src=src, group=group)
            payload[pos:pos + n].copy_(buf[:n])
        pos += n
    return payload


def sync_state(
    group: dist.ProcessGroup | None,
    committed_step: int,
    holds_state: bool,
    get_state: Callable[[], Any],
    set_state: Callable[[Any], None],
    device: torch.device | None = None,
    before_send: Callable[[int], None] | None = None,
) -> SyncResult:
    """Collective over `group`: afterwards every rank holds the newest committed state."""
    device = device or torch.device("cpu")
    world = dist.get_world_size(group)
    mine = torch.tensor([committed_step if holds_state else -1], dtype=torch.int64, device=device)
    table = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    steps = [int(t.item()) for t in table]
    best = max(steps)
    if best < 0:
        raise NoStateError("no member of the new generation holds any committed state")
    holders = [r for r, s in enumerate(steps) if s == best]
    needy = [r for r, s in enumerate(steps) if s != best]
    me = dist.get_rank(group)
    source, received = None, 0
    for i, rank in enumerate(needy):
        sender = holders[i % len(holders)]
        if me == sender:
            if before_send is not None:
                before_send(best)
            header, tensors = pack(get_state())
            blob = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
            total = sum(t.numel() * t.element_size() for t in tensors)
            sizes = torch.tensor([blob.numel(), total], dtype=torch.int64)
            dst = _global(group, rank)
            for t in (sizes, blob):
                dist.send(t.to(device), dst=dst, group=group)
            send_tensors(tensors, total, dst, group, device)
        elif me == rank:
            src = _global(group, sender)
            sizes = torch.zeros(2, dtype=torch.int64, device=device)
            dist.recv(sizes, src=src, group=group)
            blob = torch.empty(int(sizes[0]), dtype=torch.uint8, device=device)
            dist.recv(blob, src=src, group=group)
            header = json.loads(bytes(blob.cpu().numpy()).decode())
            payload = recv_bytes(int(sizes[1]), src, group, device)
            set_state(unpack(header, payload))
            source, received = sender, int(sizes[1])
    return SyncResult(step=best, source=source, received_bytes=received)


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of one tensor, flat, on its own device (a copy only if it is not
    contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
