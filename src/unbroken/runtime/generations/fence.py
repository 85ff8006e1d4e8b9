"""The fence before every update: no update is queued behind a collective that can still be
aborted (docs/design-notes.md, "The fence").

On NCCL a collective is a kernel on a stream. `wait()` orders the stream, not the CPU: the
CPU runs ahead into the optimizer's update, whose kernels queue behind the gradient
reduction. `ncclCommAbort` makes a kernel in flight return *normally*, with partial data,
so an update queued behind an aborted all-reduce applies half-reduced gradients, and the
step would be committed with state no fault-free run has (nccl-risks, risk 1). Gloo fails a
collective on the CPU, which is why the CPU tests never showed it.

So before every update of a tracked optimizer, in place:

1. the current CUDA stream is synchronised, unless `query()` says it has drained (a loop
   that already synchronises, reading its loss say, pays nothing); once per step: a second
   optimizer's update in the same step only checks the flags;
2. the update is refused (`UpdateRefused`, a peer error the engine recovers in place) if
   the watchdog aborted this generation (its flag is set *before* it interrupts the groups)
   or any NCCL backend of the generation reports an error (`get_error()`, which also sees
   torch's own aborts).

A step commits only after its update passed the fence (`engine.commit` follows the update).
The fence is an optimizer step pre-hook (`TrackedState`), so `run.train`, the framework
adapters and any later loop get it without code of their own; a step that runs its
forward and backward inside `optimizer.step(closure)` (Lightning) calls `Engine.fence`
itself after the closure, and the pre-hook, which comes before the closure, passes.
An optimizer that updates inside backward, or whose step holds collectives
(`ZeroRedundancyOptimizer`), cannot be fenced: in-place recovery is turned off
(`unfenceable`).

Decide apart from doing: `refusal` is pure; `Fence` does the stream synchronisation and
reads the flags.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from unbroken.errors import UpdateRefused
from unbroken.runtime.position import Position


def refusal(gen: int, aborted: bool, errors: Sequence[str]) -> str | None:
    """Why the update of a step in generation `gen` must not be queued, or None. `aborted`:
    the watchdog aborted `gen`; `errors`: the NCCL backends that report an error. Pure."""
    if aborted:
        return (f"generation {gen} was aborted before the update: its gradients may be "
                "partial, the update is refused")
    if errors:
        return (f"generation {gen}'s communicators report an error before the update "
                f"({', '.join(errors)}): its gradients may be partial, the update is refused")
    return None


def drain_stream() -> bool:
    """Synchronise the current CUDA stream unless it has drained; True if it had to wait.
    Nothing where CUDA was never initialised (a CPU job)."""
    if not torch.cuda.is_initialized():
        return False
    stream = torch.cuda.current_stream()
    if stream.query():
        return False
    stream.synchronize()
    return True


def unfenceable(optimizers: Sequence[torch.optim.Optimizer], model: torch.nn.Module) -> str | None:
    """Why the updates of `optimizers` cannot be fenced (one line), or None: an optimizer
    whose step holds collectives, or parameters updated inside backward."""
    for optimizer in optimizers:
        if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
            return ("ZeroRedundancyOptimizer's step holds collectives, which the fence before "
                    "the update cannot order")
    if any(hasattr(p, "_in_backward_optimizers") for p in model.parameters()):
        return ("an optimizer steps inside backward, where no fence can stand between the "
                "gradient reduction and the update")
    return None


class Fence:
    """The fence of one worker's engine (the module's docstring). Main thread only."""

    def __init__(self, position: Callable[[], Position], aborted: Callable[[int], bool],
                 nccl_errors: Callable[[], list[str]],
                 before: Callable[[int, Callable[[], bool]], None] = lambda s, a: None) -> None:
        """`position()`: the engine's; `aborted(gen)`: the watchdog aborted `gen`;
        `nccl_errors()`: the current groups' NCCL backends that report an error;
        `before(step, aborted)`: called first (injected faults at the `update` point; its
        `aborted()` says whether the current generation was aborted)."""
        self._position, self._aborted, self._nccl_errors = position, aborted, nccl_errors
        self._before = before
        self._drained: tuple[int, int] | None = None  # (gen, step) whose stream was drained
        self.waits = 0
        """How many times the stream had not drained (the fence's cost, `gpu_check` I)."""

    def __call__(self) -> None:
        """Before an update (after clipping, before any optimizer updates): raises
        `UpdateRefused` if it must not be queued."""
        pos = self._position()
        self._before(pos.step, lambda: self._aborted(pos.gen))
        if self._drained != (pos.gen, pos.step):
            self.waits += drain_stream()
            self._drained = (pos.gen, pos.step)
        why = refusal(pos.gen, self._aborted(pos.gen), self._nccl_errors())
        if why is not None:
            raise UpdateRefused(why)
