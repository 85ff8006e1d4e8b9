"""The state a step commits: the model, its optimizers, and any other `state_dict` objects.

`TrackedState` turns them into a state dict (for checkpoints and peers) and back, runs the
update that commits a step, and knows whether what it holds is whole: not while an update
or a peer's state overwrites it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from unbroken.errors import UpdateRefused, UserError


class TrackedState:
    """What `run.track(model, *optimizers, **extra)` registered."""

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                 extra: dict[str, Any]) -> None:
        """Raises `UserError` if an extra object has no `state_dict`/`load_state_dict`."""
        for name, obj in extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise UserError(f"track({name}=...): {type(obj).__name__} has no "
                                "state_dict/load_state_dict")
        optimizers = [_inner(optimizer) for optimizer in optimizers]
        self.model, self.optimizers, self.extra = model, optimizers, extra
        self.whole = True
        """False while an update or a restore overwrites the tensors (a fault then leaves
        this rank without committed state); an update the fence refused before any tracked
        optimizer began leaves it whole."""
        self.fence: Callable[[], None] | None = None
        """Called before any tracked optimizer updates (`runtime/generations/fence.py`; set by the engine
        in place); raises to refuse the update."""
        self._began = False  # within `updating()`: a tracked optimizer passed the fence
        for optimizer in optimizers:
            optimizer.register_step_pre_hook(self._before_update)

    def state_dict(self, step: int, rng: bool = True) -> dict[str, Any]:
        """The state at committed step `step`: a checkpoint's (with this rank's RNG state),
        or a peer's (`rng=False`: per rank, and re-seeded from the step anyway)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # ~1 s; on first use

        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        ours: dict[str, Any] = {"step": torch.tensor(step)}
        if rng:
            ours["rng_cpu"] = torch.get_rng_state()
        state: dict[str, Any] = {"model": model_sd, "unbroken": ours}
        if self.optimizers:
            state["optim"] = optim_sd
        for name, obj in self.extra.items():
            state[f"extra_{name}"] = obj.state_dict()
        return state

    def restore(self, state: dict[str, Any]) -> int:
        """Load `state` (from `state_dict`) in place; return its step."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.whole = False
        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))
        for name, obj in self.extra.items():
            if f"extra_{name}" in state:  # the runtime's own may be missing from an old one
                obj.load_state_dict(state[f"extra_{name}"])
        if "rng_cpu" in state["unbroken"]:  # a checkpoint's; state from a peer has none
            # A copy of its own: a staged copy's is a view into one flat buffer, which
            # torch's generator cannot take (it reads the storage, not the view).
            torch.set_rng_state(state["unbroken"]["rng_cpu"].clone())
        self.whole = True
        return int(state["unbroken"]["step"])

    def tear(self) -> None:
        """The tensors are about to be overwritten (a peer's state arriving): not whole."""
        self.whole = False

    def _before_update(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        """Every tracked optimizer's step pre-hook (`begin_update`). A step given a closure
        runs its forward and backward inside (Lightning): its caller calls `begin_update`
        after the closure (`Engine.fence`), and this hook, before it, passes."""
        if kwargs.get("closure") is not None or (args and callable(args[0])):
            return
        self.begin_update()

    def begin_update(self) -> None:
        """An optimizer is about to update: the fence, which may refuse it (`UpdateRefused`).
        Refused before any tracked optimizer of the update began, the state is as committed:
        whole again, even inside `updating()`."""
        if self.fence is not None:
            try:
                self.fence()
            except UpdateRefused:
                self.whole = self.whole or not self._began
                raise
        self._began = True

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Around an update that overwrites the state: torn if it raises (unless the fence
        refused it first, `begin_update`). The block's first change to the state must be a
        tracked optimizer's step (fenced at its start) or come after `begin_update`."""
        self.whole, self._began = False, False
        yield
        self.whole = True

    def update(self) -> None:
        """The commit of a step: step the optimizers (clearing their gradients) and the
        tracked LR schedulers. Called after backward, with every rank's gradients reduced."""
        with self.updating():
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for obj in self.extra.values():
                if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                    obj.step()

    def discard_gradients(self) -> None:
        """Drop what a step accumulated that was never committed."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer a wrapper steps (Accelerate's `AcceleratedOptimizer` holds it as
    `.optimizer` and has no step hooks of its own), or `optimizer` itself."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and not hasattr(optimizer, "_optimizer_step_pre_hooks"):
        return inner
    return optimizer
