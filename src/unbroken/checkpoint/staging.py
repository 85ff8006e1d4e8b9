"""Phase one of a checkpoint, staging: copy the state into reusable CPU buffers, off the
loop's path.

Only the optimizer update overwrites parameters and optimizer state, so those large tensors
are copied by the checkpoint's background thread while the next step's forward and backward
run; the optimizers' step pre-hook waits for the copy (`Checkpointer.protect`). Everything
else (buffers such as BatchNorm statistics, which a forward pass updates; counters; RNG
state; Python values such as the learning rate, which a scheduler changes) is copied at once.
The buffer (one, of exactly the staged bytes) is allocated on the first save and reused, so
a checkpoint costs no allocation; a data-parallel rank stages only the replicated tensors
it writes (`writers.assign`).
A sharded job in place already holds one host copy of its shards (the peer snapshots' own
copy, `runtime/sharded/snapshots.py`), taken at every checkpoint step: `stage` is then given it as a
`HostImage`, and its tensors are persisted from that copy's views, not copied again.
On GPU the buffer is pinned (registered, exact size) and filled on a side stream; DTensor shards stay DTensors, so the
persisted checkpoint keeps its sharding and reshards on load.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from unbroken.checkpoint.host_buffer import HostBuffer, Layout, separate, typed_view
from unbroken.checkpoint.writers import Path, Replicated


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
    pinned: int = 0  # host bytes the staging area held pinned for it
    writers: dict[Path, int] = field(default_factory=dict)  # replicated tensor -> its writer
    items: dict[Path, Replicated] = field(default_factory=dict)  # the replicated tensors


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
    """One flat host buffer of exactly the staged tensors' size for one training state;
    `stage` then `copy_pending`.

    "Staging", as torch DCP's async save calls it: not the peer snapshots of sharded state
    (`runtime/sharded/snapshots.py`), which are another thing. On GPU the buffer is pinned
    by registering it (`host_buffer.HostBuffer`): the bytes pinned are the bytes staged, not
    a power of two per tensor, and the allocation is reused while the layout holds."""

    def __init__(self, available: Callable[[], int] | None = None) -> None:
        """`available`: host memory this rank may use, in bytes (None: not checked); a
        buffer that would take more than 80 % of it is refused (`refusal`)."""
        self.available = available
        self._host: HostBuffer | None = None
        self._layout: Layout | None = None
        self._raws: list[torch.Tensor] = []  # each tensor's bytes in the buffer
        self._shape: list[Any] = []  # (place, dtype, shape) of each, when `_views` was made
        self._views: dict[Path, torch.Tensor] = {}
        self._streams: dict[Any, Any] = {}  # device -> side stream
        self.paths: list[Path] = []  # the places of the tensors the last `stage` copied

    @property
    def pinned_bytes(self) -> int:
        """Host memory this area holds pinned (registered with CUDA) now."""
        return self._host.pinned_bytes if self._host is not None else 0

    @property
    def host_bytes(self) -> int:
        """Host memory this area holds now, pinned or not."""
        return self._host.nbytes if self._host is not None else 0

    def close(self) -> None:
        """Unregister the buffer and let it go (a save still reading views keeps its bytes,
        unpinned); the next `stage` allocates afresh."""
        if self._host is not None:
            self._host.close()
        self._host, self._layout, self._raws, self._shape = None, None, [], []

    def stage(self, state: dict[str, Any], late: Callable[[torch.Tensor], bool],
              image: HostImage | None = None, leave_out: frozenset[Path] = frozenset()) -> Staged:
        """Copy now what may change before the next optimizer update; defer the rest.

        `late(t)`: True for tensors only an optimizer update changes (parameters and
        optimizer state), which the background thread copies. A tensor that `image` holds
        is not copied: its view in the image takes its place (the writer waits for the
        image). `leave_out`: the places (`writers.Path`) of tensors in dicts that another
        rank writes: left out of the staged state altogether. The buffer is re-made only
        when the staged tensors' sizes change.
        """
        staged = Staged(state={})
        wanted: list[tuple[Path, torch.Tensor]] = []
        _collect(state, (), image, leave_out, wanted)
        layout = Layout.of([t for _, t in wanted])
        if layout != self._layout or self._host is None:
            self.close()
            pin = any(t.is_cuda for _, t in wanted)
            if self.available is not None and (why := refusal(layout.total, self.available(),
                                                              pin)):
                raise MemoryError(why)
            self._host, self._layout = HostBuffer(layout.total, pin=pin), layout
            # Storages of their own (DCP clones a view of a larger one), made once per layout.
            self._raws = separate(self._host.tensor, layout)
        self.paths = [path for path, _ in wanted]  # what this save stages, in buffer order
        shape = [(path, t.dtype, t.shape) for path, t in wanted]
        if shape != self._shape:  # the typed views too are made once, while the state holds
            self._shape = shape
            self._views = {path: typed_view(raw, t)
                           for (path, t), raw in zip(wanted, self._raws, strict=True)}
        views = self._views
        staged.state = self._walk(state, (), late, staged, image, views, leave_out)
        staged.pinned = self.pinned_bytes
        if any(src.is_cuda for src, _ in staged.pending):
            staged.device = torch.cuda.current_device()
            staged.ready = torch.cuda.Event()
            staged.ready.record()
        return staged

    def _walk(self, obj: Any, path: Path, late: Callable[[torch.Tensor], bool], staged: Staged,
              image: HostImage | None, views: dict[Path, torch.Tensor],
              leave_out: frozenset[Path]) -> Any:
        if isinstance(obj, torch.Tensor):
            src = local_tensor(obj).detach()
            held = image.view_of(src) if image is not None else None
            buf = held if held is not None else views[path]
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
            return {k: self._walk(v, (*path, k), late, staged, image, views, leave_out)
                    for k, v in obj.items() if (*path, k) not in leave_out}
        if isinstance(obj, (list, tuple)):
            items = [self._walk(v, (*path, i), late, staged, image, views, leave_out)
                     for i, v in enumerate(obj)]
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


def refusal(nbytes: int, available: int, pinned: bool) -> str | None:
    """Why a staging buffer of `nbytes` would not fit in `available` bytes of host memory
    (at most 80 % of it is used), with the figures; or None."""
    if nbytes <= 0.8 * available:
        return None
    kind = "pinned " if pinned else ""
    return (f"the checkpoint's staged copy needs {nbytes / 2**20:.0f} MiB of {kind}host memory "
            f"on this rank and {available / 2**20:.0f} MiB is available: the save is skipped "
            "(lower the state's size per rank, or give the pod more memory)")


def _collect(obj: Any, path: Path, image: HostImage | None, leave_out: frozenset[Path],
             out: list[tuple[Path, torch.Tensor]]) -> None:
    """The tensors `stage` copies into its buffer (neither left out nor held by `image`), in
    the order `_walk` meets them."""
    if isinstance(obj, torch.Tensor):
        src = local_tensor(obj).detach()
        if image is None or image.view_of(src) is None:
            out.append((path, src))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if (*path, k) not in leave_out:
                _collect(v, (*path, k), image, leave_out, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect(v, (*path, i), image, leave_out, out)
