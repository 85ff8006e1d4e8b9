"""A stateful loader's place in the data, kept for a redo and published for whoever takes
the rank.

A loader with `state_dict()` and `load_state_dict()` (torchdata's `StatefulDataLoader`, or
any of the user's own with that pair) is positioned by its state, whatever it iterates: a
per-rank stream, a sampler of its own, a dataset that packs documents. Its state is the
rank's own and differs from rank to rank, so a rank's loss would lose its place in the data.
Each rank therefore keeps a `Mark` (its state before the step it drew last) and publishes
it to the control store (`LOADER_STATE`, run-level: `loader/<rank>`) from a thread of its
own, latest only: a slow write skips marks in between, never the newest. Whoever stands at
step `s` for rank `r` (the survivor itself, a promoted spare, a replacement) loads the
newest mark of `r` at or before `s` and draws and drops the batches in between: exact for a
loader whose batches are a function of its state, in as many draws as the publication lags
(usually none or one step's). A mark of a world of another size is never used; with no
usable mark (a restart from an older checkpoint: the store's mark is newer) the loader's
first state is loaded and the batches before `s` are drawn again (exact; their cost).

A published state is `torch.save`d and loaded with `weights_only=True`: tensors and plain
values, never code.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.control.channel import Channel
from unbroken.control.messages import LoaderState
from unbroken.control.schema import loader_state


def stateful(loader: Any) -> bool:
    """The loader has a state of its own to save and load (torchdata's
    `StatefulDataLoader`). Pure."""
    return callable(getattr(loader, "state_dict", None)) and \
        callable(getattr(loader, "load_state_dict", None))


def encode_state(state: dict[str, Any]) -> str:
    """`state` as text for the control store (`torch.save`, base64)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_state(text: str) -> dict[str, Any]:
    """A state from `encode_state`, loaded as tensors and plain values only."""
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)


@dataclass(frozen=True)
class Mark:
    """A loader's state before the `micro`-th batch of the run, drawn for `rank` of a world of
    `world_size`, in epoch `epoch` (the sampler's `set_epoch`)."""

    micro: int
    epoch: int
    rank: int
    world_size: int
    state: dict[str, Any]

    def serves(self, micro: int, rank: int, world_size: int) -> bool:
        """It positions `rank` of a world of `world_size` at `micro` (by draws forward). Pure."""
        return (self.rank, self.world_size) == (rank, world_size) and self.micro <= micro


class MarkStore:
    """The control store's marks: published from a thread with a connection of its own,
    read on the caller's (the main) thread through `channel`.

    `open_channel()` makes the publishing thread's connection (a channel is not shared
    between threads). `close()` publishes the newest mark and stops the thread."""

    def __init__(self, channel: Callable[[], Channel], open_channel: Callable[[], Channel],
                 on_error: Callable[[str], None]) -> None:
        self._channel, self._open = channel, open_channel
        self._on_error = on_error
        self._cv = threading.Condition()
        self._newest: Mark | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    def publish(self, mark: Mark) -> None:
        """Hand `mark` to the publishing thread (returns at once; replaces one not yet sent)."""
        with self._cv:
            self._newest = mark
            if self._thread is None:
                self._thread = threading.Thread(target=self._publish_loop, daemon=True,
                                                name="unbroken-loader-state")
                self._thread.start()
            self._cv.notify()

    def fetch(self, rank: int) -> Mark | None:
        """The newest mark published for `rank`, or None."""
        got = self._channel().read(loader_state(rank))
        if got is None:
            return None
        return Mark(got.micro, got.epoch, rank, got.world_size, decode_state(got.state))

    def close(self, timeout: float = 10.0) -> None:
        """Publish what is pending, then stop (bounded by `timeout`)."""
        with self._cv:
            self._closing = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _publish_loop(self) -> None:
        channel: Channel | None = None
        while True:
            with self._cv:
                while self._newest is None and not self._closing:
                    self._cv.wait()
                mark, self._newest = self._newest, None
                if mark is None:
                    return
            try:
                channel = channel or self._open()
                channel.write(loader_state(mark.rank),
                              LoaderState(mark.micro, mark.epoch, mark.world_size,
                                          encode_state(mark.state)))
            except Exception as exc:  # the next mark tries again; the event says so
                self._on_error(f"{type(exc).__name__}: {exc}")
