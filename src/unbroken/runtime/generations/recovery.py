"""In-place recovery, inside a worker: leave a broken generation, join the next one.

Leaving aborts the generation's groups (so peers blocked on us fail at once) and tells the
leader what we hold. Joining waits for a plan naming us, meets the other members, forms the
new groups under the generation's own store prefix, and brings every member to the newest
committed state. If anything fails on the way (a member dies mid-switch, the state sender
among them) we leave that generation too and wait for the next plan; the leader bounds the
whole thing and falls back to a full restart, so it never hangs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from unbroken.control.messages import LeaveReason
from unbroken.errors import first_line, is_peer_error
from unbroken.runtime.generations.membership import Membership, Plan
from unbroken.runtime.generations.release import forget_frames, out_of_memory, release
from unbroken.runtime.generations.state_sync import NoStateError, SyncResult, sync_state
from unbroken.runtime.generations.watchdog import NO_WATCHDOG, Watchdog
from unbroken.runtime.groups.process_group import (
    AbortableGroups,
    CheckpointGroups,
    drain_device,
    nccl_backed,
)
from unbroken.runtime.position import Position
from unbroken.telemetry import schema as ev

DRAIN_BOUND = 10.0
"""Seconds a planned switch waits for the device's work in flight (a step's update, the
collectives after its commit) before it aborts the old groups anyway: past it, a member
must have died in a collective, and the switch is a fault's (bounded below by the join
timeout)."""


FORM_SLACK = 10.0
"""Seconds past the join timeout after which a worker still forming a generation's NCCL
groups exits (`exit_if_stuck`): gloo's rendezvous and init time out at the join timeout,
NCCL's blocking init waits for a member that never arrives without end."""


@contextmanager
def exit_if_stuck(bound: float, gen: int, armed: bool) -> Iterator[None]:
    """Around forming generation `gen`'s groups: if it has not returned within `bound`
    seconds (and `armed`: NCCL), say so and exit, so that this worker's agent replaces it
    and the job goes on (a process blocked in `ncclCommInitRank` cannot be woken)."""
    if not armed:
        yield
        return

    def stuck() -> None:
        print(f"unbroken: generation {gen}'s NCCL groups did not form within {bound:g} s (a "
              "member never arrived, and NCCL's init does not time out): this worker exits, "
              "and its agent replaces it", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(bound, stuck)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@dataclass
class Switch:
    """One completed switch into a generation, with the time each phase took."""

    plan: Plan
    position: Position  # where this worker stands in the new generation, holding its state
    sync: SyncResult
    ckpt_groups: CheckpointGroups | None
    view: Any  # what the user's build() returned in the new generation
    phases: dict[str, float]  # wait_plan, gather, form, sync, build: seconds
    tries: int  # generations tried before this one held
    rolled_back: int  # committed steps given up to resume where every shard is held


class Generations:
    def __init__(self, membership: Membership, groups: AbortableGroups, backend: str,
                 timeout: float, join_timeout: float, record: Callable[..., None],
                 fault_point: Callable[[str, int], None] = lambda point, step: None) -> None:
        self.membership = membership
        self.groups = groups  # generation 0's, formed by init(); then each switch's
        self.backend = backend
        self.timeout = timeout
        self.join_timeout = join_timeout
        self.record = record
        self.fault_point = fault_point  # injected faults at recovery points (tests, benchmarks)
        self.gen = 0
        self.sharded = False  # set by the run: departures say so, and the leader waits
        self.fixed_world: str | None = None  # what fixed the world size (`Engine.fix_world`)
        self.watchdog: Watchdog = NO_WATCHDOG
        """The engine's (set when it starts): a switch's state sync and rebuild are inside
        its abort window, so that a member dying then fails them at once (the leader breaks
        the generation being joined) instead of after the collective timeout."""

    def fix_world(self, who: str) -> None:
        """`who` (e.g. "the Trainer") caches the world size: from now on every departure of
        this worker says so, and the leader never shrinks the job in place; a lost rank waits
        for a spare or a replacement, whatever `--on-fault` says (docs/design-notes.md, "A
        fixed world"). Called before the first step, on every rank."""
        self.fixed_world = who

    def report_up(self, switch: Switch) -> None:
        """Tell the leader we are ready to train in the switch's generation."""
        self.membership.report_up(switch.plan)

    def leave(self, step: int, holds_state: bool, reason: LeaveReason,
              **detail: Any) -> bool | None:
        """Leave the current generation; peers blocked on it fail now. A planned switch
        (`SWITCH`: every member healthy, at a step boundary) first lets the device's work
        in flight finish (`drain_device`, bounded by `DRAIN_BOUND`), so that the abort
        interrupts no healthy collective; whether it did is returned (None: not planned)."""
        drained = None
        if reason is LeaveReason.PEER:  # the flight recorder's evidence, before the abort
            self.watchdog.dump("peer", self.gen)
        if reason is LeaveReason.SWITCH:
            drained = drain_device(min(DRAIN_BOUND, self.join_timeout))
            self.fault_point("teardown", step)
        self.groups.abort()
        self.membership.leave(self.gen, step, holds_state, reason, sharded=self.sharded,
                              fixed_world=self.fixed_world,
                              **detail)
        return drained

    def replicated(self, get_state: Callable[[], Any], set_state: Callable[[Any], None],
                   ) -> Callable[[Plan, int, bool], SyncResult]:
        """The state step of a switch for replicated state (DDP): the newest committed
        state, whole, from a member that holds it (`state_sync`)."""
        def sync(plan: Plan, committed_step: int, holds_state: bool) -> SyncResult:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if nccl_backed(self.backend, torch.cuda.is_available()) else None)
            return sync_state(None, committed_step, holds_state, get_state, set_state,
                              device=device,
                              before_send=lambda step: self.fault_point("send", step))
        return sync

    def join(self, position: Position, sync: Callable[[Plan, int, bool], SyncResult],
             build: Callable[[Position], Any], whole: Callable[[], bool],
             joining: bool = False,
             formed: Callable[[Plan, CheckpointGroups | None, int], None] = (
                 lambda plan, groups, step: None),
             ) -> Switch:
        """Join the next generation that names us, from `position` (the step we left at,
        and whether we hold its state), with the newest committed state, and rebuild what
        depends on the group (`build(position)`: DDP's constructor is collective too).

        `sync(plan, committed_step, holds_state)` brings every member the state to resume
        from (collective over the new default group; `replicated`, or `ShardedSync.sync`).
        `formed(plan, groups, step)` runs once the state is synced, before `build`:
        collectives it issues (the checkpointer's) fail over to the next plan like the rest
        of the switch. `whole()` says whether the tracked state is still whole after a failed
        try (a receipt may have torn it). Raises `NoStateError` if no member holds state,
        `JobFinished`, `Drained` or `RecoveryTimeout` from the membership."""
        tries = ooms = 0
        committed_step, holds_state = position.step, position.holds_state
        while True:
            tries += 1
            freed = release()  # the old generation's memory, before the new one is made
            t0 = time.monotonic()
            plan = self.membership.next_plan(self.gen, joining=joining)
            t1 = time.monotonic()
            if not self.membership.gather(plan):
                # Superseded before it formed (a member died on the way): say so, so that
                # the leader can plan the next one.
                self.gen = plan.gen
                self.leave(committed_step, holds_state, LeaveReason.SUPERSEDED)
                continue
            t2 = time.monotonic()
            self.gen = plan.gen
            try:
                self.fault_point("join", committed_step)
                store = self.membership.store_for(plan, self.join_timeout)
                with exit_if_stuck(self.join_timeout + FORM_SLACK, plan.gen,
                                   nccl_backed(self.backend, torch.cuda.is_available())):
                    ckpt_groups = self.groups.form(store, plan.rank, plan.world_size,
                                                  self.backend, self.join_timeout, self.timeout)
                t3 = time.monotonic()
                self.watchdog.entered(plan.gen, committed_step)  # abortable from here
                try:
                    result = sync(plan, committed_step, holds_state)
                    t4 = time.monotonic()
                    rolled_back = max(0, committed_step - result.step) if holds_state else 0
                    committed_step, holds_state = result.step, True
                    formed(plan, ckpt_groups, result.step)
                    arrived = Position(plan.rank, plan.world_size, result.step, plan.gen, True)
                    view = build(arrived)
                finally:
                    self.watchdog.left()
                t5 = time.monotonic()
            except (NoStateError, TypeError) as exc:
                # Nobody holds state, or ours cannot travel whole (sharded): a checkpoint must.
                self.record(ev.SwitchFailed(gen=plan.gen, error=first_line(exc)))
                self.leave(committed_step, holds_state and whole(), LeaveReason.NO_STATE,
                           error=first_line(exc))
                raise NoStateError(str(exc)) from exc
            except Exception as exc:  # a member died or left mid-switch: try the next plan
                oom = out_of_memory(exc)  # the switch's fault, never the user's
                if not (oom or is_peer_error(exc)):
                    raise
                forget_frames(exc)
                ooms += oom
                self.record(ev.SwitchFailed(gen=plan.gen, error=first_line(exc),
                                            out_of_memory=oom or None))
                holds_state = holds_state and whole()
                if ooms > 1:  # freed once and out of memory again: the job restarts
                    self.leave(committed_step, holds_state, LeaveReason.NO_STATE,
                               error=f"out of memory twice in a switch: {first_line(exc)}")
                    raise NoStateError(first_line(exc)) from None
                self.leave(committed_step, holds_state,
                           LeaveReason.OUT_OF_MEMORY if oom else LeaveReason.PEER,
                           error=first_line(exc))
                joining = joining and not holds_state
                continue
            phases = {"free": freed, "wait_plan": t1 - t0, "gather": t2 - t1, "form": t3 - t2,
                      "sync": t4 - t3, "build": t5 - t4}
            return Switch(plan, arrived, result, ckpt_groups, view,
                          {k: round(v, 6) for k, v in phases.items()}, tries, rolled_back)
