"""Fires the injected faults inside a worker: at the start of a step, at a recovery point,
or, for the numeric kinds, at the point of the step their kind names.

A fault fires once per job, not once per attempt: after a restart the run resumes from a
checkpoint taken before the fault's step, and a fault that fired again would loop forever.
`claim(key)` (the control plane) is True only for the first process of the job to ask.

A `persistent=1` fault, and a `slow` window (`steps` > 1), belong to the process whose claim
succeeded (`_held`): it fires again on every later matching execution there (the rerun of
the step, a replay after a rollback) without claiming again; a replacement process cannot
claim it, so it never fires there. An injector keeps only the faults of the rank it was
made with: a spare (rank -1) keeps none, and keeps none when promoted.

torch is imported only inside the methods that need it: this module is imported by
processes that must not load torch.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from unbroken.errors import UserError
from unbroken.faults.spec import NUMERIC_POINTS, FaultSpec
from unbroken.telemetry import schema as ev

if TYPE_CHECKING:
    import torch


class InjectedFault(RuntimeError):
    """The exception raised by an `exception` fault."""


def _sleep(seconds: float) -> None:
    time.sleep(seconds)  # looked up at each call, so that a patched time.sleep is seen


_WAKE_SLICE = 0.02  # s: how often a `slow` with `until=abort` looks at its generation


class FaultInjector:
    def __init__(
        self,
        faults: list[FaultSpec],
        rank: int,
        claim: Callable[[str], bool],
        record: ev.Emit,
        *,
        sleep: Callable[[float], None] = _sleep,
    ) -> None:
        """`claim(key)` returns True only the first time a key is claimed in the job;
        `record` takes a `FaultInjected` before each firing; `sleep` does every sleep."""
        mine = [f for f in faults if f.rank == rank]
        self._by_step: dict[int, list[FaultSpec]] = {}
        self._windows: list[FaultSpec] = []  # slow, steps > 1
        self._at_points: list[FaultSpec] = []
        self._numeric: dict[str, list[FaultSpec]] = {}
        for fault in mine:
            if fault.kind in NUMERIC_POINTS:
                self._numeric.setdefault(fault.kind, []).append(fault)
            elif fault.at != "step":
                self._at_points.append(fault)
            elif fault.steps > 1:
                self._windows.append(fault)
            else:
                self._by_step.setdefault(fault.step, []).append(fault)
        self._kinds = {f.kind for f in mine}
        self._claim = claim
        self._record = record
        self._sleep = sleep
        self._held: set[str] = set()  # keys this process claimed and fires again
        self._frozen: dict[str, float] = {}  # a slow window's key -> its step time

    def has(self, kind: str) -> bool:
        """Whether any fault of `kind` is kept for this rank (callers skip work if not)."""
        return kind in self._kinds

    def at_step(self, step: int, step_time: float | None = None) -> None:
        """At the start of `step`. `step_time`: the last step's duration in seconds, for a
        `slow` fault with `factor=` (None when not known: such a fault then sleeps 0, and a
        window freezes the first step time it is given)."""
        self._fire(self._by_step.get(step, ()), step, step_time)
        for fault in self._windows:
            if fault.step <= step < fault.step + fault.steps and self._take(fault, hold=True):
                self._emit(fault, step)
                self._sleep(self._slow_seconds(fault, step_time))

    def at_point(self, point: str, step: int,
                 aborted: Callable[[], bool] = lambda: False) -> None:
        """At a point (`join`, `send`: recovery points; `update`: before step `step`'s update)
        while holding committed step `step`. `aborted()`: the generation was aborted (a
        `slow` fault with `until=abort` sleeps until it says so, or its `seconds` end)."""
        self._fire([f for f in self._at_points if f.at == point and step >= f.step], step,
                   aborted=aborted)

    def corrupt_gradients(self, step: int, params: Sequence[torch.Tensor]) -> bool:
        """A `nan` fault of `step`: element 0 (flat) of the first of `params` with a
        non-empty gradient (its local shard, for a DTensor) becomes NaN. After backward,
        before the gradients are checked. Returns whether it fired."""
        fired = False
        for fault in self._due("nan", step):
            grads = [g for g in (_local(p.grad) for p in params if p.grad is not None)
                     if g.numel() > 0]
            if not grads:
                raise UserError(f"fault {fault}: no parameter given has a gradient to poison")
            if not self._take(fault, hold=fault.persistent):
                continue
            self._emit(fault, step)
            import torch

            with torch.no_grad():
                grads[0][(0,) * grads[0].dim()] = float("nan")
            fired = True
        return fired

    def scale_loss(self, step: int, loss: float, params: Sequence[torch.Tensor]) -> float:
        """A `spike` fault of `step`: every present gradient of `params` is multiplied by
        its `scale` in place, and `loss * scale` returned; otherwise `loss` unchanged. After
        backward, with the loss about to be checked."""
        for fault in self._due("spike", step):
            if not self._take(fault, hold=fault.persistent):
                continue
            self._emit(fault, step)
            import torch

            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        _local(p.grad).mul_(fault.scale)
            loss = loss * fault.scale
        return loss

    def corrupt_update(self, step: int, params: Sequence[torch.Tensor]) -> bool:
        """A `bitflip` fault of `step`: bit `bit` of flat element `index` of `params[param]`
        (its local shard, for a DTensor) is flipped in place, through an integer view of
        the same storage. After the update. Returns whether it fired. A parameter, element
        or bit that does not exist, or a non-contiguous parameter, is a UserError."""
        fired = False
        for fault in self._due("bitflip", step):
            bits = _int_view(fault, params)
            if not self._take(fault, hold=fault.persistent):
                continue
            self._emit(fault, step)
            import torch

            nbits = 8 * bits.element_size()
            mask = 1 << fault.bit
            if mask >= 1 << (nbits - 1):
                mask -= 1 << nbits  # the top bit, as the signed integer type holds it
            with torch.no_grad():
                bits[fault.index:fault.index + 1].bitwise_xor_(mask)
            fired = True
        return fired

    def _due(self, kind: str, step: int) -> list[FaultSpec]:
        return [f for f in self._numeric.get(kind, ()) if f.step == step]

    def _take(self, fault: FaultSpec, hold: bool) -> bool:
        """Whether `fault` fires now: this process holds it, or its claim succeeds (and
        then, if `hold`, this process holds it from now on)."""
        if fault.key in self._held:
            return True
        if not self._claim(fault.key):
            return False
        if hold:
            self._held.add(fault.key)
        return True

    def _emit(self, fault: FaultSpec, step: int) -> None:
        self._record(ev.FaultInjected(fault=str(fault), kind=fault.kind, step=step,
                                      at=fault.point))

    def _slow_seconds(self, fault: FaultSpec, step_time: float | None) -> float:
        if fault.factor is None:
            return fault.seconds
        if fault.key not in self._frozen and step_time is not None:
            self._frozen[fault.key] = step_time
        return (fault.factor - 1) * self._frozen.get(fault.key, 0.0)

    def _fire(self, faults: Iterable[FaultSpec], step: int, step_time: float | None = None,
              aborted: Callable[[], bool] = lambda: False) -> None:
        for fault in faults:
            if not self._take(fault, hold=False):
                continue
            self._emit(fault, step)
            if fault.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "exception":
                raise InjectedFault(f"injected fault {fault}")
            elif fault.kind == "device_error":
                import torch

                raise torch.AcceleratorError(f"CUDA error: an illegal memory access was "
                                             f"encountered (injected fault {fault})")
            elif fault.kind == "slow" and fault.until == "abort":
                self._sleep_until(aborted, fault.seconds)
            elif fault.kind == "slow":
                self._sleep(self._slow_seconds(fault, step_time))

    def _sleep_until(self, woken: Callable[[], bool], seconds: float) -> None:
        """Sleep up to `seconds`, in slices of `_WAKE_SLICE`, until `woken()`."""
        left = seconds
        while left > 0 and not woken():
            self._sleep(min(_WAKE_SLICE, left))
            left -= _WAKE_SLICE


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _int_view(fault: FaultSpec, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The flat integer view of the parameter a `bitflip` fault names."""
    import torch

    if fault.param >= len(params):
        raise UserError(f"fault {fault}: param={fault.param}, but {len(params)} parameter(s) "
                        "were given")
    t = _local(params[fault.param]).detach()
    if not t.is_contiguous():
        raise UserError(f"fault {fault}: parameter {fault.param} is not contiguous")
    size = t.element_size()
    dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    if dtype is None:
        raise UserError(f"fault {fault}: parameter {fault.param} ({t.dtype}) has "
                        f"{size}-byte elements; bitflip takes 1, 2, 4 or 8")
    if fault.bit >= 8 * size:
        raise UserError(f"fault {fault}: bit={fault.bit}, but {t.dtype} has {8 * size} bits")
    if fault.index >= t.numel():
        raise UserError(f"fault {fault}: index={fault.index}, but parameter {fault.param} "
                        f"has {t.numel()} element(s)")
    return t.view(-1).view(dtype)
