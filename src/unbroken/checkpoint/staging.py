"""Phase one of a checkpoint, staging: copy the state into reusable CPU buffers, off the
loop's path.

Only the optimizer update overwrites parameters and optimizer state, so those large tensors
are copied by the checkpoint's background thread while the next step's forward and backward
run; the optimizers' step pre-hook waits for the copy (`Checkpointer.protect`). Everything
else (buffers such as BatchNorm statistics, which a forward pass updates; counters; RNG
state; Python values such as the learning rate, which a scheduler changes) is copied at once.
Buffers are allocated on the first save and reused, so a checkpoint costs no allocation.
A sharded job in place already holds one host copy of its shards (the peer snapshots' own
copy, `runtime/sharded/snapshots.py`), taken at every checkpoint step: `stage` is then given it as a
`HostImage`, and its tensors are persisted from that copy's views, not copied again.
On GPU they are pinned and filled on a side stream; DTensor shards stay DTensors, so the
persisted checkpoint keeps its sharding and reshards on load.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Staged:
    """A staged copy being taken: `state` has the structure of the original with CPU
    buffers in place of tensors; `pending` are the copies still to do (source, buffer)."""

    state: dict[str, Any]
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    ready: Any = None  # on GPU: an event marking where the main stream had got to
    device: Any = None  # on GPU: the training thread's device (the copy thread has its own)
    nbytes: int = 0


class HostImage(Protocol):
    """A host copy of (some of) the live tensors, taken by someone else at the step being
    saved; the writer holds a lease on it from `stage` until `release`."""

    def view_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The copy of live local tensor `t`, or None if the image does not hold it."""

    def wait(self) -> str | None:
        """Until the copy is complete (the writer's thread); why it is not, or None."""

    def release(self) -> None:
        """The writer is done reading the copy."""


class StagingArea:
    """Reusable CPU buffers for one training state; `stage` then `copy_pending`.

    "Staging", as torch DCP's async save calls it: not the peer snapshots of sharded state
    (`runtime/sharded/snapshots.py`), which are another thing."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: set[str] = set()  # the keys the current save uses
        self._streams: dict[Any, Any] = {}  # device -> side stream

    def _buffer(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        self._used.add(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            pin = like.is_cuda
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def stage(self, state: dict[str, Any], late: Callable[[torch.Tensor], bool],
              image: HostImage | None = None) -> Staged:
        """Copy now what may change before the next optimizer update; defer the rest.

        `late(t)`: True for tensors only an optimizer update changes (parameters and
        optimizer state), which the background thread copies. A tensor that `image` holds
        is not copied: its view in the image takes its place (the writer waits for the
        image). Buffers this save does not use are freed.
        """
        staged = Staged(state={})
        self._used = set()
        staged.state = self._walk(state, "", late, staged, image)
        self._buffers = {k: v for k, v in self._buffers.items() if k in self._used}
        if any(src.is_cuda for src, _ in staged.pending):
            staged.device = torch.cuda.current_device()
            staged.ready = torch.cuda.Event()
            staged.ready.record()
        return staged

    def _walk(self, obj: Any, key: str, late: Callable[[torch.Tensor], bool], staged: Staged,
              image: HostImage | None) -> Any:
        if isinstance(obj, torch.Tensor):
            src = local_tensor(obj).detach()
            held = image.view_of(src) if image is not None else None
            buf = held if held is not None else self._buffer(key, src)
            staged.nbytes += buf.numel() * buf.element_size()
            if held is not None:
                pass  # the image's copy: complete once image.wait() returns
            elif late(src):
                staged.pending.append((src, buf))
            else:
                buf.copy_(src)
            if isinstance(obj, DTensor):
                # Same mesh and placements around the CPU shard: DCP saves it as a shard.
                return DTensor(buf, obj._spec, requires_grad=False)
            return buf
        if isinstance(obj, dict):
            return {k: self._walk(v, f"{key}/{k}", late, staged, image) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._walk(v, f"{key}/{i}", late, staged, image) for i, v in enumerate(obj)]
            return type(obj)(items) if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)

    def copy_pending(self, staged: Staged) -> None:
        """The deferred copies; run by the checkpoint thread, concurrently with training."""
        if staged.ready is not None:
            # The current CUDA device is per thread: this one starts on device 0.
            torch.cuda.set_device(staged.device)
            stream = self._streams.get(staged.device)
            if stream is None:
                stream = self._streams[staged.device] = torch.cuda.Stream(device=staged.device)
            stream.wait_event(staged.ready)
            with torch.cuda.stream(stream):
                for src, buf in staged.pending:
                    buf.copy_(src, non_blocking=src.is_cuda)
            stream.synchronize()
        else:
            for src, buf in staged.pending:
                buf.copy_(src)
        staged.pending.clear()
