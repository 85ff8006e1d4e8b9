"""What an old generation leaves in memory, let go before the next one is built.

On a GPU, anything that keeps the old generation alive while `build()` makes the new one
holds its device memory: the old DDP's gradient buckets, FSDP2's unsharded parameters after
an abort mid-forward, the activations of the step that failed, aborted groups with their
stashed tensors. Most of it is reachable only from the failed step's traceback (its frames'
locals) or from reference cycles. So a worker that leaves a generation:

1. forgets the failed step's frames (`forget_frames`): their locals are cleared, so the
   activations and the old view they held are dropped with the last other reference;
2. collects cycles and hands the CUDA caching allocator's free blocks back (`release`),
   before the new generation's groups and view are made.

An out-of-memory error while a switch runs (its state sync or the rebuild) is a fault of
the switch, never the user's (`out_of_memory`): the switch is tried once more after
`release`, then the job restarts (`Generations.join`).
"""

from __future__ import annotations

import gc
import time
import traceback

import torch

from unbroken.errors import out_of_memory_text


def forget_frames(exc: BaseException) -> None:
    """Clear the locals of the frames `exc` was raised through (those that have returned; the
    handler's own frame keeps running), and of the exceptions it chains."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def release() -> float:
    """Collect what the old generation left (cycles included) and return the CUDA cache's
    free blocks to the device; the seconds it took. `unbroken.init()` froze what existed
    then (`gc.freeze`), so a collection walks only what the script made since."""
    t0 = time.monotonic()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return time.monotonic() - t0


def out_of_memory(exc: BaseException) -> bool:
    """The error is an allocation that did not fit (device or host): `errors`' test, which
    `classify` uses too."""
    return out_of_memory_text(type(exc).__name__, str(exc))
