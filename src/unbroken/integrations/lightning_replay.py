"""The batches of Lightning's update in flight, recorded and run again (for the strategy of
`integrations/lightning.py`).

Under gradient accumulation an update is several batches, each run in its own training-step
closure, the last one inside the strategy's `optimizer_step`. The update is redone when a
peer's fault drops it (in the new generation) or when the engine's check asks for a rerun:
each batch is recorded with the RNG state it started with (the default generator's and the
device's, those the engine seeds at `enter`), so that the earlier batches run again on the
same inputs and draws, their reduction deferred as Lightning defers it, and the batch in
flight then again from its own RNG state. The batches' training-step losses are kept on the
device for the engine's check.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The RNG state the engine seeds (`enter`): the default generator's, the device's."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.default_generator.get_state(), torch.cuda.get_rng_state() if cuda else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.default_generator.set_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class UpdateBatches:
    """The update in flight's batches, each `(batch, batch_idx, RNG state)`: those before
    the one in flight (`earlier`), and that one (`current`; None between updates); with
    their training-step losses."""

    def __init__(self) -> None:
        self.earlier: list[tuple[Any, int, Any]] = []
        self.current: tuple[Any, int, Any] | None = None
        self.losses: list[torch.Tensor] = []  # the update's batches' losses, on the device

    @property
    def in_update(self) -> bool:
        """An update's batch already started (a batch that starts now is a later one)."""
        return self.current is not None

    def first(self, batch: Any, batch_idx: int) -> None:
        """An update's first batch starts (after the engine seeded the RNG)."""
        self.current, self.losses = (batch, batch_idx, _rng_state()), []

    def later(self, batch: Any, batch_idx: int) -> None:
        """A later batch of the update starts (gradient accumulation)."""
        self.earlier.append(self.current)
        self.current = (batch, batch_idx, _rng_state())

    def record_loss(self, out: Any) -> None:
        """A batch's training-step output: its loss, kept."""
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach())  # on the device: one host sync, at the check

    def mean_loss(self) -> float | None:
        """The mean of the update's batches' losses (one host sync), or None if none."""
        return float(torch.stack(self.losses).float().mean()) if self.losses else None

    def clear(self) -> None:
        """The update is over (committed, or no update made)."""
        self.earlier, self.current, self.losses = [], None, []

    def replay(self, trainer: Any, strategy: Any) -> int:
        """Start the update over: the gradients zeroed, the earlier batches run again (each
        a training-step closure of Lightning's automatic optimization) on the same inputs
        and RNG states, their reduction deferred (the strategy's `block_backward_sync`),
        then the RNG set to the batch in flight's start. Returns how many batches ran."""
        for optimizer in trainer.optimizers:
            optimizer.zero_grad()
        self.losses = []
        loop = trainer.fit_loop.epoch_loop
        for batch, batch_idx, rng in self.earlier:
            _set_rng_state(rng)
            kwargs = loop._build_kwargs(OrderedDict(), batch, batch_idx)
            closure = loop.automatic_optimization._make_closure(kwargs, trainer.optimizers[0],
                                                                batch_idx)
            with strategy.block_backward_sync():
                closure()
            closure.consume_result()
        if self.current is not None:
            _set_rng_state(self.current[2])
        return len(self.earlier)
