"""Flat host buffers of exact size: where each tensor lies in one buffer (`Layout`) and the
buffer itself (`HostBuffer`), pinned when device copies fill or drain it.

torch's pinned allocations (`pin_memory=True`) go through its caching host allocator, which
rounds every block up to a power of two and keeps it for the life of the process: a state
of 5 GiB pinned tensor by tensor can hold up to 10 GiB of memory that cannot be swapped.
A `HostBuffer` is one pageable allocation of exactly `Layout.total` bytes, registered with
CUDA (`cudaHostRegister`, as torch DCP's own staging does) when `pinned` is asked for and a
GPU is there, and unregistered by `close()`: the bytes pinned are the bytes used.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64
"""Each tensor starts at a multiple of this many bytes in a host buffer: any dtype's view of
it is aligned, so a restore or a checkpoint reads it in place."""


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a list lies in one flat host buffer: `ALIGN`-aligned."""

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


def separate(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Each tensor's bytes in `flat` (a contiguous uint8 host tensor) as a tensor with a
    storage of exactly its own size, aliasing `flat`'s memory (which it keeps alive). DCP
    clones a tensor whose storage is larger than itself before it writes it (a view of one
    flat buffer would be copied again, in the writer, for every tensor): these it writes
    from where they lie."""
    if not layout.sizes:
        return []
    whole = memoryview(flat.numpy()).cast("B")
    return [torch.frombuffer(whole[o:o + n], dtype=torch.uint8) if n else
            torch.empty(0, dtype=torch.uint8)
            for o, n in zip(layout.offsets, layout.sizes, strict=True)]


def typed_view(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`raw` (bytes, `ALIGN`-aligned) seen as a contiguous tensor of `like`'s dtype and shape."""
    if like.numel() == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    return raw.view(like.dtype).view(like.shape)


def cuda_ready() -> bool:
    """A GPU is there and CUDA is initialised in this process (registering never starts it)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class HostBuffer:
    """One pageable host allocation of exactly `nbytes`, registered with CUDA (pinned) when
    `pin` and a GPU is there. `close()` unregisters it; the tensor's memory goes when the last
    view of it does."""

    def __init__(self, nbytes: int, pin: bool = False) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned_bytes = 0
        self._unpin: Any = None
        if pin and nbytes and cuda_ready():
            _register(self.tensor.data_ptr(), nbytes)
            self.pinned_bytes = nbytes
            # Unregistered before its memory is freed, whoever drops it last (the tensor
            # is still alive when a weak reference's callback runs).
            self._unpin = weakref.finalize(self, _unregister, self.tensor.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        """Unregister the buffer (its views stay readable, as pageable memory); safe twice."""
        if self._unpin is not None:
            self._unpin()  # a finalizer runs once
            self.pinned_bytes = 0


def chunks(views: list[torch.Tensor], size: int) -> Iterator[torch.Tensor]:
    """The non-empty pieces of at most `size` bytes of each byte view, in order."""
    for v in views:
        for pos in range(0, v.numel(), size):
            yield v[pos:pos + size]


def _register(ptr: int, nbytes: int) -> None:
    # cudaHostRegisterPortable (1): pinned for every device of the process, as DCP's staging.
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {code})")


def _unregister(ptr: int) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if code != 0:
        raise RuntimeError(f"cudaHostUnregister failed (cudaError {code})")
