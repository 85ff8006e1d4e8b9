"""Fires the injected faults inside a worker, at the start of the named step.

Each fault fires once per job, not once per attempt: after a restart the run resumes from a
checkpoint taken before the fault's step, and a fault that fired again would loop forever.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from unbroken.faults.spec import FaultSpec
from unbroken.telemetry import schema as ev


class InjectedFault(RuntimeError):
    """The exception raised by an `exception` fault."""


class FaultInjector:
    def __init__(
        self,
        faults: list[FaultSpec],
        rank: int,
        claim: Callable[[str], bool],
        record: ev.Emit,
    ) -> None:
        """`claim(key)` returns True only the first time a key is claimed in the job."""
        self._by_step: dict[int, list[FaultSpec]] = {}
        self._at_points: list[FaultSpec] = []
        for fault in faults:
            if fault.rank != rank:
                continue
            if fault.at == "step":
                self._by_step.setdefault(fault.step, []).append(fault)
            else:
                self._at_points.append(fault)
        self._claim = claim
        self._record = record

    def at_step(self, step: int) -> None:
        self._fire(self._by_step.get(step, ()), step)

    def at_point(self, point: str, step: int) -> None:
        """At a recovery point (`join`, `send`) while holding committed step `step`."""
        self._fire([f for f in self._at_points if f.at == point and step >= f.step], step)

    def _fire(self, faults: list[FaultSpec] | tuple, step: int) -> None:
        for fault in faults:
            if not self._claim(fault.key):
                continue
            self._record(ev.FaultInjected(fault=str(fault), kind=fault.kind, step=step,
                                          at=fault.at))
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
            elif fault.kind == "slow":
                time.sleep(fault.seconds)
