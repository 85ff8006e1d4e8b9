"""The straggler detector's executor: each rank's own step times gathered every `batch`
steps, judged by the pure detector (`runtime/anomalies/stragglers.py`), recorded, and remedied.
Main thread only; the gather is collective on the training group, at committed steps that
are multiples of `batch` (the same on every rank).

A rank's own time is from the step's start to its first gradient bucket (`step_probe`):
no wait for a peer is in it, so a slow rank stands out while its peers, who wait for it in
the all-reduce, do not. Without a probe mark (no DDP hook of ours, FSDP) the step's whole
time is used, which every rank shares: then only a job-wide slowdown shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from unbroken.runtime import step_probe
from unbroken.runtime.anomalies import stragglers
from unbroken.runtime.anomalies.gather import gather
from unbroken.runtime.config import StragglerConfig, StragglerRemedy
from unbroken.telemetry import schema as ev


class StragglerWatch:
    """One worker's straggler detector. `file_drain(slot)` asks the leader to move a slot
    onto a ready spare (True once filed); None: no control plane, report only."""

    def __init__(self, config: StragglerConfig, emit: ev.Emit,
                 file_drain: Callable[[int], bool] | None) -> None:
        self.config = config
        self.emit = emit
        self.file_drain = file_drain
        self.state = stragglers.initial(config)
        self.times: list[float] = []
        self.gen: int | None = None
        self.probed = False  # a probe mark was seen: own times exclude peers' waits

    def watch(self, view: Any) -> None:
        """A new generation's view: a DDP without a comm hook gets the plain all-reduce,
        timed (DDP has one hook slot; ours mark the probe themselves)."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        if isinstance(view, DDP) and not getattr(view, "_comm_hooks", [True]):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            view.register_comm_hook(view.process_group, step_probe.timed(allreduce_hook))

    def record(self, started: float, ended: float, gen: int) -> None:
        """A committed step that started at `started` and ended at `ended` (perf_counter)."""
        first = step_probe.take()
        if gen != self.gen:  # a switch: the times before it are another world's
            self.gen, self.times = gen, []
            self.state = stragglers.reset(self.state, self.config)
        self.probed = self.probed or first is not None
        self.times.append((first if first is not None else ended) - started)

    def after_commit(self, step: int, slot: int, node: int, rank: int) -> None:
        """Every `batch` committed steps: gather, judge, act (collective)."""
        c = self.config
        if step % c.batch != 0:
            return
        own = (self.times + [math.nan] * c.batch)[:c.batch] if len(self.times) <= c.batch \
            else self.times[-c.batch:]
        self.times = []
        rows = gather(torch.tensor([*own, slot, node], dtype=torch.float64))
        kept = [(int(r[-2]), int(r[-1]), tuple(x for x in r[:-2] if not math.isnan(x)))
                for r in rows]
        if len(kept) < 2 or any(not times for _, _, times in kept):
            return
        point = stragglers.Point(step=step, slots=tuple(k[0] for k in kept),
                                 nodes=tuple(k[1] for k in kept), own=tuple(k[2] for k in kept))
        self.state, actions = stragglers.decide(self.state, point, c)
        if rank == 0:
            for action in actions:
                self._act(action)

    def _act(self, a: stragglers.Action) -> None:
        if isinstance(a, stragglers.Flag):
            self.emit(ev.StragglerFlagged(straggler=a.slot, straggler_node=a.node, step=a.step,
                                          since_step=a.since_step, ratio=round(a.ratio, 4),
                                          own_ms=round(a.own_s * 1e3, 3),
                                          peers_ms=round(a.peers_s * 1e3, 3)))
            if not a.drain:
                self.emit(ev.StragglerRemedied(straggler=a.slot, step=a.step, action="report",
                                               reason=a.reason or str(self.config.remedy)))
        elif isinstance(a, stragglers.Drain):
            filed = self.file_drain is not None and self.file_drain(a.slot)
            self.emit(ev.StragglerRemedied(
                straggler=a.slot, step=a.step, action="drain" if filed else "report",
                reason="filed with the leader: a ready spare takes the slot, else it is "
                       "refused (drain_refused)" if filed else "no control plane to drain"))
        elif isinstance(a, stragglers.Clear):
            self.emit(ev.StragglerCleared(straggler=a.slot, step=a.step))
        elif isinstance(a, stragglers.JobSlow):
            self.emit(ev.JobSlow(step=a.step, ratio=round(a.ratio, 4)))

    def describe(self) -> str:
        line = stragglers.summary(self.config)
        if self.config.remedy == StragglerRemedy.DRAIN and self.file_drain is None:
            line += " (no control plane: report only)"
        return line
