"""Per-step helpers of the loop: the RNG seed of a step, and the forward's progress marks."""

from __future__ import annotations

from typing import Any

import torch

from unbroken.runtime.heartbeat import HeartbeatWriter


def seed_step(seed: int, step: int, slot: int) -> None:
    """Seed the RNGs from (seed, step, slot), so that a step redone, or run by a replacement
    of the slot, draws the same numbers. Not `torch.manual_seed`: it costs ~80 us."""
    value = (seed * 1_000_003 + step) * 10_007 + slot
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(value)


class ProgressMarks:
    """Mark the model's forward, entered and returned, on the heartbeat page, so that a rank
    stuck before it (data loading, a kernel) is seen behind the ranks already in the gradient
    collective. On the current view only: the last view's hooks go with it."""

    def __init__(self, heartbeat: HeartbeatWriter | None) -> None:
        self._heartbeat = heartbeat
        self._hooks: list[Any] = []

    def watch(self, view: Any) -> None:
        """Move the marks onto `view` (what `build()` returned for this generation)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._heartbeat is not None and isinstance(view, torch.nn.Module):
            self._hooks = [view.register_forward_pre_hook(self._advance),
                           view.register_forward_hook(self._advance)]

    def _advance(self, *_: Any) -> None:
        self._heartbeat.advance()
