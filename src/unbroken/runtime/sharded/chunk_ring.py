"""Device bytes sent to peers over a host group through a bounded ring of pinned chunks.

A GPU rank's snapshot round sends its shards over gloo, which reads host memory. Copying the
whole shard to the host first (`.cpu()` on every chunk) would take one more shard of host
memory per rank, on every rank of a node at once, outside the budget, and queue each copy
on the thread's default stream behind the next step's compute. The ring instead holds
`slots` pinned chunks: chunk `i` is copied into slot `i % slots` on the ring's own CUDA
stream (after the event that marks where the main stream stood when the round began), and
its sends are posted; a slot is reused only after every send of the chunk it held has
completed. Host memory for the exchange: `slots * chunk` bytes, whatever the shard's size.

Contract: `send` waits on its own sends as it reuses slots, so a peer's receives for these
chunks must be posted by then without waiting on ours (`PeerSnapshots._exchange` posts
every receive before it sends a chunk). On CPU (the tests' gloo), `pin` is False and the
slots are plain host memory: the same control flow, with copies that are plain copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from unbroken.checkpoint.host_buffer import HostBuffer


class ChunkRing:
    """`slots` host chunks of `chunk` bytes each, pinned when `pin` and a GPU is there;
    allocated at the first `send`, unregistered by `close`."""

    def __init__(self, slots: int, chunk: int, pin: bool = True) -> None:
        if slots < 1 or chunk < 1:
            raise ValueError("a chunk ring needs at least one slot of at least one byte")
        self.slots, self.chunk, self.pin = slots, chunk, pin
        self._buffers: list[HostBuffer] = []
        self._stream: Any = None
        self.copies = 0  # chunks copied through the ring so far (its checks read it)
        self.waits = 0  # sends waited for before a slot was reused

    @property
    def host_bytes(self) -> int:
        """The ring's host memory: what a round's exchange adds to the budget."""
        return self.slots * self.chunk

    @property
    def pinned_bytes(self) -> int:
        return sum(b.pinned_bytes for b in self._buffers)

    def send(self, pieces: Iterable[torch.Tensor], post: Callable[[torch.Tensor, int], list[Any]],
             ready: Any = None) -> list[Any]:
        """Copy each piece (at most `chunk` bytes, any device) into the next slot and post its
        sends (`post(host_bytes, index)` returns their works). `ready`: a CUDA event recorded
        on the main stream when the pieces were current; the ring's copies wait for it.
        Returns the works still outstanding (the caller waits for them)."""
        if not self._buffers:
            self._buffers = [HostBuffer(self.chunk, pin=self.pin) for _ in range(self.slots)]
        outstanding: list[list[Any]] = [[] for _ in range(self.slots)]
        for i, piece in enumerate(pieces):
            if piece.numel() > self.chunk:
                raise ValueError(f"a piece of {piece.numel()} bytes is larger than the ring's "
                                 f"chunks ({self.chunk})")
            slot = i % self.slots
            for work in outstanding[slot]:
                work.wait()  # the slot's last chunk is sent: its bytes may be overwritten
                self.waits += 1
            host = self._buffers[slot].tensor[:piece.numel()]
            self._copy(piece, host, ready)
            self.copies += 1
            outstanding[slot] = post(host, i)
        return [w for works in outstanding for w in works]

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], ready: Any = None) -> None:
        """Each (host destination, source) copied, device sources on the ring's stream after
        `ready` (never behind the next step's compute on the default stream); returns when
        every byte is on the host. The round's own copy goes this way."""
        for host, src in pairs:
            self._copy(src, host, ready, sync=False)
        if self._stream is not None:
            self._stream.synchronize()

    def _copy(self, piece: torch.Tensor, host: torch.Tensor, ready: Any,
              sync: bool = True) -> None:
        if not piece.is_cuda:
            host.copy_(piece)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=piece.device)
        with torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            host.copy_(piece, non_blocking=True)
        if sync:
            self._stream.synchronize()  # the bytes are on the host before gloo reads them

    def close(self) -> None:
        """Unregister the pinned chunks and let them go; a later `send` makes new ones."""
        for b in self._buffers:
            b.close()
        self._buffers = []
