"""When a step's own work ends: the moment its first gradient bucket reaches a DDP comm hook.

A rank's own time for a step runs from the step's start to that moment: its data, its
forward and the backward up to the first bucket, and no wait for a peer (the first
collective has not begun). The straggler detector compares ranks by it
(`runtime/anomalies/stragglers.py`). DDP has one comm-hook slot, so every hook we own marks the probe
(`exact_allreduce`, `timed_allreduce`), and `timed(hook)` wraps a script's own.

Process-wide state, main thread (DDP calls hooks from the backward's thread: the autograd
engine's, which on CPU is the caller's); read and reset once per step by the engine.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

_first: float | None = None


def mark() -> None:
    """A gradient bucket reached its hook: the first mark of a step is kept."""
    global _first
    if _first is None:
        _first = time.perf_counter()


def take() -> float | None:
    """The step's first mark (perf_counter seconds), or None; resets the probe."""
    global _first
    first, _first = _first, None
    return first


def timed(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` (a DDP comm hook) that first marks the probe: register this instead, so the
    straggler detector sees this rank's own time (docs/anomalies.md)."""

    @functools.wraps(hook)  # DDP checks the hook's annotations: they are the hook's own
    def timed_hook(state: Any, bucket: Any) -> Any:
        mark()
        return hook(state, bucket)

    return timed_hook
