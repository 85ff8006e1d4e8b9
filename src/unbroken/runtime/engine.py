"""The recovery engine: the step transaction that any training loop drives.

`run.train` is one client; framework adapters are others. The contract (the order of calls,
which are collective, what may raise) is in docs/engine.md. In short, per step:

    step = engine.begin()            # None: done. A due switch happens here first.
    try:
        engine.enter(step)           # injected faults, the step's RNG seed
        ...forward and backward...   # the loop's own work, on `engine.view`
    except Exception as exc:
        engine.fail(step, exc)       # in place: leave, join, sync, rebuild; else raises
        continue
    with engine.updating():          # or engine.update() for the tracked optimizers
        optimizer.step()
    engine.commit(step, metrics)     # the step is committed; checkpoints and snapshots

The engine holds the worker's `Position` and replaces it in one place (`_move`). Its
collaborators (the event log, heartbeat, fault injector, checkpointer, generations) are
passed in, so that it can run in-process against fakes that implement their protocols.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from unbroken.checkpoint.checkpointer import Checkpointer
from unbroken.control.messages import LeaveReason
from unbroken.errors import (
    ErrorClass,
    UserError,
    classify,
    current_device,
    first_line,
    is_peer_error,
)
from unbroken.faults.inject import FaultInjector
from unbroken.runtime import spare
from unbroken.runtime.heartbeat import (
    PHASE_CHECKPOINT,
    PHASE_DONE,
    PHASE_RECOVERY,
    PHASE_STARTING,
    PHASE_TRAINING,
    HeartbeatWriter,
)
from unbroken.runtime.membership import Drained, JobFinished, Plan, RecoveryTimeout
from unbroken.runtime.position import Position
from unbroken.runtime.process_group import AbortableGroups, CheckpointGroups
from unbroken.runtime.progress import ProgressMarks, seed_step
from unbroken.runtime.recovery import Generations
from unbroken.runtime.shard_sync import ShardedSync, build_sharded
from unbroken.runtime.shards import is_fake_world, is_sharded
from unbroken.runtime.state_sync import NoStateError, SyncResult, pack
from unbroken.runtime.tracked import TrackedState
from unbroken.runtime.watchdog import Watchdog
from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import EventLog


@dataclass(frozen=True)
class EngineSettings:
    """What the engine is told once, at `unbroken.init()`."""

    in_place: bool
    """Recover in place (under `unbroken run`); False: a fault restarts every worker."""
    slot: int
    """The logical slot: the original rank, which a replacement inherits (a spare's is set
    when it is promoted)."""
    wid: str
    """This worker process's id in the generation protocol."""
    spare: bool = False
    """A hot spare: warms up in a sandbox and waits to be promoted."""
    joining: bool = False
    """A spare or a replacement: it joins a planned generation rather than generation 0."""
    seed: int | None = 0
    """Seed torch's RNG from (seed, step, slot) before each step; None: leave it alone."""
    shadow_steps: int = 0
    """A spare's warm-up steps."""
    snapshot_every: int | None = None
    """Sharded state: an in-memory snapshot every N steps (None: automatic; 0: none)."""
    snapshot_replicas: int = 1
    """Sharded state: buddies that hold a copy of each snapshot."""
    local_world: int = 1
    """Workers on this node (snapshot buddies go to other nodes)."""
    timeout: float = 1800.0
    """Collectives' timeout, in seconds."""


class Engine:
    """One worker's recovery engine. Main thread only, except the watchdog's abort."""

    def __init__(self, position: Position, settings: EngineSettings, *, events: EventLog,
                 faults: FaultInjector, groups: AbortableGroups,
                 heartbeat: HeartbeatWriter | None = None,
                 checkpointer: Checkpointer | None = None,
                 generations: Generations | None = None,
                 available_memory: Callable[[], int] = lambda: 0) -> None:
        """`generations` is required for in-place recovery (`settings.in_place`)."""
        self.settings = s = settings
        self.events, self.faults, self.groups = events, faults, groups
        self.heartbeat, self.checkpointer, self.generations = heartbeat, checkpointer, generations
        self._available_memory = available_memory
        self._position = position
        self.in_place = s.in_place and generations is not None
        self.joining, self.slot = s.joining, s.slot
        self.tracked: TrackedState | None = None
        self.view: Any = None
        """What `build()` returned for the current generation (the model without one)."""
        self.step_time: float | None = None  # moving average, for time-based intervals
        self.owns_group = False  # the runtime formed the default group: close() destroys it
        self._build: Callable[[], Any] | None = None
        self._last_step = 0
        self._resilient = False  # start() was called: switches, seeds and the watchdog
        self._sharded: ShardedSync | None = None
        self._watchdog: Watchdog | None = None
        self._marks = ProgressMarks(heartbeat)
        self._t0 = 0.0

    # ------------------------------------------------------------------ position
    @property
    def position(self) -> Position:
        return self._position

    def _move(self, position: Position) -> None:
        """The one place the position changes hands."""
        self._position = position

    def stamp(self, step: int, phase: int) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stamp(step, phase)

    # ------------------------------------------------------------------ state
    def track(self, tracked: TrackedState) -> None:
        self.tracked = tracked
        if self.checkpointer is not None:
            self.checkpointer.protect(tracked.model, tracked.optimizers)

    def state_dict(self) -> dict[str, Any]:
        """The committed state, as a checkpoint holds it."""
        return self._need_tracked("checkpointing or run.steps()").state_dict(self._position.step)

    def _need_tracked(self, what: str) -> TrackedState:
        if self.tracked is None:
            raise UserError(f"call run.track(model, optimizer) before {what}")
        return self.tracked

    def save_checkpoint(self) -> bool:
        """Start a checkpoint of the committed state now (collective); False if deferred."""
        if self.checkpointer is None:
            raise UserError("no checkpoint_dir was given to unbroken.init()")
        state = self._need_tracked("checkpointing").state_dict(self._position.step)
        return self.checkpointer.start(state, self._position.step, self.step_time)

    def resume(self) -> None:
        """Load the newest checkpoint, if any (collective over the checkpoint's groups)."""
        if self.checkpointer is None:
            return
        tracked = self._need_tracked("resuming from a checkpoint")
        self.stamp(self._position.step, PHASE_CHECKPOINT)
        built: list[dict[str, Any]] = []  # the state, built only if there is one to load

        def build() -> dict[str, Any]:
            built.append(tracked.state_dict(self._position.step))
            return built[0]

        if self.checkpointer.load_latest(build) is not None:
            self._move(self._position.moved(step=tracked.restore(built[0]), holds_state=True))
        self.stamp(self._position.step, PHASE_TRAINING)

    # ------------------------------------------------------------------ the transaction
    def start(self, last_step: int, build: Callable[[], Any] | None,
              shadow_step: Callable[[int, Any], Any]) -> None:
        """Enter the job for a resilient loop up to `last_step` (collective): resume from the
        checkpoint, or (a spare) warm up, wait for promotion and join, or (a replacement)
        join. `build()` makes the view a step runs on (once per generation); `shadow_step`
        is the loop's step, which a spare runs in its sandbox. May exit the process (0): a
        spare or replacement that the job never needed."""
        tracked = self._need_tracked("run.train()")
        self._build, self._last_step, self._resilient = build, last_step, True
        self._move(self._position.moved(holds_state=not self.joining))
        if self.in_place and is_sharded(tracked.model):
            self._setup_sharded(tracked)
        if self.settings.spare:
            self._warm_up(shadow_step)
            self._await_promotion()
            self._join("spare")
        elif self.joining:
            self._join("replacement")
        else:
            self.resume()
            self.view = self._build_view()
            self._check_in_place()
        pos = self._position
        self.events.emit(Event.RESUME, step=pos.step, total=last_step, gen=pos.gen)
        if self.heartbeat is not None and self.in_place:
            self.heartbeat.set_generation(pos.gen)
            self._watchdog = Watchdog(self.heartbeat, self.groups.interrupt,
                                      self._aborted_on_notice)
            self._watchdog.start()

    def start_plain(self, last_step: int) -> None:
        """Enter the job for a loop that steps the optimizer itself, up to `last_step`:
        resume from the checkpoint. No in-place recovery: a fault restarts every worker."""
        if self.checkpointer is not None:
            self._need_tracked("run.steps() to checkpoint")
        self._last_step = last_step
        self.resume()
        self.events.emit(Event.RESUME, step=self._position.step, total=last_step)

    def begin(self) -> int | None:
        """The step to run next, or None when the run is done. Between steps; a switch the
        leader asked for happens here first (collective, like the step)."""
        while (step := self._position.step) < self._last_step:
            self.stamp(step, PHASE_TRAINING)
            if self._resilient and self.in_place and self._switch_due(step):
                self._leave_and_join(LeaveReason.SWITCH)
                continue
            self._t0 = time.perf_counter()
            if self._watchdog is not None:
                self._watchdog.entered(self._position.gen, step)
            return step
        return None

    def enter(self, step: int) -> None:
        """Inside the step, first: injected faults fire here, and the RNG is seeded."""
        self.faults.at_step(step)
        if self._resilient and self.settings.seed is not None:
            seed_step(self.settings.seed, step, self.slot)

    def update(self) -> None:
        """Step the tracked optimizers and schedulers: the update a commit records."""
        self._need_tracked("run.train()").update()

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Around an update the loop makes itself: the state is torn if it raises."""
        with self._need_tracked("an update").updating():
            yield

    def commit(self, step: int, metrics: dict[str, float] | None = None) -> None:
        """After the update of `step`: it is committed. Then a checkpoint or a snapshot
        round if one is due (collective), and the final checkpoint after the last step.
        A peer's fault met here leaves and joins in place."""
        duration = time.perf_counter() - self._t0
        self._move(self._position.moved(step=step + 1, holds_state=True))
        pos = self._position
        self.events.emit(Event.STEP, step=step, duration=round(duration, 6),
                         **({"gen": pos.gen} if self._resilient else {}), **(metrics or {}))
        try:
            try:
                self._after_commit(duration)
                if self._resilient and pos.step == self._last_step:
                    self._finish_checkpoints()
            finally:
                self._left()
        except Exception as exc:
            if not (self._resilient and self.in_place and is_peer_error(exc)):
                raise
            self._leave_and_join(LeaveReason.PEER, error=first_line(exc))

    def fail(self, step: int, exc: Exception) -> None:
        """The step raised `exc`. In place: the step is dropped, and this worker leaves the
        generation and joins the next one with the newest state. Re-raises `exc` when that
        cannot help: not in place, or this process's own device is broken."""
        self._left()
        if not self.in_place:
            raise exc
        self._need_tracked("a step").discard_gradients()
        kind = classify(exc, current_device())
        if kind == ErrorClass.PEER:
            self._leave_and_join(LeaveReason.PEER, error=first_line(exc))
            return
        error = f"{type(exc).__name__}: {exc}"
        tb = "".join(traceback.format_exception(exc))[-4000:]
        self.events.emit(Event.STEP_FAILED, step=step, gen=self._position.gen, error=error,
                         traceback=tb, error_class=kind.value)
        if kind == ErrorClass.OWN_DEVICE:
            # Its CUDA context is broken for good: this process dies (its agent reports the
            # death) and a fresh one takes the rank, while the survivors go on in place.
            raise exc
        self._leave_and_join(LeaveReason.EXCEPTION, error=error, traceback=tb)

    def drop(self, step: int, reason: str) -> None:
        """Give up `step` before its update: nothing is committed and the step runs again
        (with the same seed). Local; every rank must drop the same step."""
        self._left()
        self._need_tracked("a step").discard_gradients()
        self.events.emit(Event.STEP_DROPPED, step=step, gen=self._position.gen, reason=reason)

    def rollback(self, reason: str) -> int | None:
        """Go back to the newest checkpoint (collective: every rank, between steps); the step
        resumed from, or None (and nothing changes) when there is none."""
        tracked = self._need_tracked("a rollback")
        if self.checkpointer is None:
            return None
        start = self._position.step
        self.checkpointer.wait()
        built: list[dict[str, Any]] = []

        def build() -> dict[str, Any]:
            built.append(tracked.state_dict(start))
            return built[0]

        if self.checkpointer.load_latest(build) is None:
            return None
        self._move(self._position.moved(step=tracked.restore(built[0]), holds_state=True))
        self.events.emit(Event.ROLLED_BACK, step=self._position.step, from_step=start,
                         reason=reason)
        return self._position.step

    def finish(self) -> None:
        """After the last step: report done (first: a done heartbeat means the leader counts
        this member done) and stamp the heartbeat."""
        pos = self._position
        if self._resilient and self.in_place:
            self.generations.membership.report_done(pos.gen)
        self.stamp(pos.step, PHASE_DONE)
        self.events.emit(Event.TRAINING_DONE, step=pos.step,
                         **({"gen": pos.gen, "pid": os.getpid()} if self._resilient else {}))

    def finish_checkpoints(self) -> None:
        """The final state, committed before we report done (bounded by checkpoint_timeout)."""
        self._finish_checkpoints()

    def _finish_checkpoints(self) -> None:
        if self.checkpointer is None:
            return
        self.stamp(self._position.step, PHASE_CHECKPOINT)
        self.checkpointer.finish(self._need_tracked("checkpointing").state_dict(
            self._position.step), self._position.step)

    def _after_commit(self, duration: float) -> None:
        avg = self.step_time
        self.step_time = duration if avg is None else 0.9 * avg + 0.1 * duration
        if self.checkpointer is not None and self.checkpointer.due(self._position.step):
            self.save_checkpoint()
        if self._sharded is not None:
            self._sharded.after_commit(self._position.step, self._last_step, self.step_time)

    # ------------------------------------------------------------------ set-up
    def _check_in_place(self) -> None:
        """Before the first step, not at the first fault: state that cannot travel between
        peers cannot be recovered in place, so faults restart every worker from the
        checkpoint at once, with no switch tried first. Said in one line."""
        if not self.in_place:
            return
        if self._sharded is not None:
            # Generation 0's mesh on groups a leave can abort (the script's may not be).
            self._sharded.form(self._position.rank, self._position.world_size)
            return
        try:
            pack(self.tracked.state_dict(self._position.step, rng=False))
        except TypeError as exc:
            self.in_place_unavailable(str(exc))

    def in_place_unavailable(self, why: str) -> None:
        """Turn in-place recovery off, saying why (rank 0 prints it)."""
        why = f"{why}: a fault restarts every worker from the last checkpoint"
        self.events.emit(Event.IN_PLACE_UNAVAILABLE, reason=why)
        self._say(f"in-place recovery is not available: {why}")
        self.in_place = False

    def _say(self, line: str) -> None:
        if self._position.rank == 0:
            print(f"unbroken: {line}", file=sys.stderr, flush=True)

    def _setup_sharded(self, tracked: TrackedState) -> None:
        """Sharded state (FSDP2, HSDP) recovers in place from replicas and in-memory
        snapshots; what cannot is named in one line now, not at the first fault."""
        s = self.settings
        sync = build_sharded(
            tracked.model, tracked.optimizers, tracked.extra,
            world_size=self._position.world_size, joining=self.joining,
            snapshot_every=s.snapshot_every, snapshot_replicas=s.snapshot_replicas,
            groups=self.groups, local_world=s.local_world, timeout=s.timeout,
            available=self._available_memory() // max(1, s.local_world),
            record=self.events.emit, say=self._say)
        if isinstance(sync, str):
            self.in_place_unavailable(sync)
            return
        self._sharded = sync
        self.generations.sharded = True

    def _build_view(self) -> Any:
        tracked = self.tracked
        view = tracked.model if self._build is None or not dist.is_initialized() else self._build()
        self._marks.watch(view)
        return view

    # ------------------------------------------------------------------ the spare
    def _warm_up(self, shadow_step: Callable[[int, Any], Any]) -> None:
        """A spare's shadow steps, in a world that reaches no one; then it holds nothing."""
        t0 = time.monotonic()
        shards = self._sharded.shards if self._sharded is not None else None
        pos = self._position
        self._move(pos.moved(rank=0) if shards is not None else pos.moved(rank=0, world_size=1))
        tracked = self.tracked

        def step(i: int, view: Any) -> None:
            self.stamp(i, PHASE_STARTING)
            if self.settings.seed is not None:
                seed_step(self.settings.seed, i, self.slot)
            shadow_step(i, view)
            tracked.update()

        detail = spare.warm_up(step, lambda: tracked.model if self._build is None
                               else self._build(), self.settings.shadow_steps, shards)
        self._move(self._position.moved(holds_state=False))
        self.events.emit(Event.SPARE_READY, wid=self.settings.wid,
                         shadow_steps=self.settings.shadow_steps,
                         duration=round(time.monotonic() - t0, 6), **detail)

    def _await_promotion(self) -> None:
        """Wait until the agent assigns us a slot, or exit 0 if the job ends first."""
        if self.heartbeat is None:
            raise UserError("a spare needs its agent: run the script under `unbroken run --spares N`")
        slot = spare.await_promotion(self.heartbeat, self.generations.membership.finished)
        if slot is None:
            self.events.emit(Event.JOINER_UNUSED, wid=self.settings.wid)
            self._exit()
        self.slot = slot
        self._move(self._position.moved(rank=slot))
        self.events.context["slot"] = self.events.context["rank"] = slot
        self.events.emit(Event.SPARE_PROMOTED, wid=self.settings.wid, slot=slot)

    # ------------------------------------------------------------------ switching
    def _switch_due(self, step: int) -> bool:
        """The leader asked (on the heartbeat page) for a switch at this step or before."""
        if self.heartbeat is None:
            return False
        gen, at_step = self.heartbeat.target()
        return gen > self._position.gen and step >= at_step

    def _left(self) -> None:
        if self._watchdog is not None:
            self._watchdog.left()

    def _aborted_on_notice(self, gen: int, target_gen: int, step: int) -> None:
        """The watchdog thread aborted generation `gen`: the leader had broken it."""
        self.events.emit(Event.ABORT_ON_NOTICE, gen=gen, target_gen=target_gen, step=step)

    def _leave_and_join(self, reason: LeaveReason, **detail: Any) -> None:
        t0 = time.monotonic()
        pos = self._position.moved(holds_state=self._position.holds_state and self.tracked.whole)
        self._move(pos)
        self.stamp(pos.step, PHASE_RECOVERY)
        self.view = None
        self.generations.leave(pos.step, pos.holds_state, reason, **detail)
        self.events.emit(Event.GEN_LEAVE, gen=pos.gen, step=pos.step, reason=reason.value,
                         holds_state=pos.holds_state, duration=round(time.monotonic() - t0, 6))
        self._join(reason.value)

    def _join(self, reason: str) -> None:
        """Wait for the next generation naming us; switch to it with the newest state."""
        t0 = time.monotonic()
        self.stamp(self._position.step, PHASE_RECOVERY)
        gens = self.generations
        if self.joining:
            gens.membership.register_joiner(self.slot)
        if is_fake_world():
            dist.destroy_process_group()  # the stand-in world; the plan's replaces it
        sync = self._sync_shards if self._sharded is not None else gens.replicated(
            lambda: self.tracked.state_dict(self._position.step, rng=False), self.tracked.restore)
        try:
            switch = gens.join(self._position, sync, self._build_at, lambda: self.tracked.whole,
                               joining=self.joining, formed=self._checkpoints_formed)
        except (JobFinished, Drained) as exc:
            drained = isinstance(exc, Drained)
            self.events.emit(Event.DRAINED if drained else Event.JOINER_UNUSED, slot=self.slot,
                             **({"step": self._position.step, "pid": os.getpid()}
                                if drained else {}))
            self._exit()  # the job ended before it needed us, or a spare took our rank
        except NoStateError:
            # We left saying why (`switch_failed`); the leader now restarts every worker from
            # the checkpoint, and stops us. Exiting first would read as a fault of our own.
            try:
                gens.membership.await_finished()
            except RecoveryTimeout:
                pass
            raise
        self.joining = False
        self._move(switch.position)
        self.view = switch.view
        self.owns_group = True  # formed by the runtime: close() tears it down
        gens.report_up(switch)
        pos = self._position
        self.events.context["rank"] = pos.rank
        self.stamp(pos.step, PHASE_TRAINING)
        if self.heartbeat is not None:
            self.heartbeat.set_generation(pos.gen)
        self.events.emit(Event.GEN_SWITCH, gen=pos.gen, reason=reason, step=pos.step,
                         world_size=pos.world_size, state_from=switch.sync.source,
                         received_bytes=switch.sync.received_bytes, tries=switch.tries,
                         rolled_back=switch.rolled_back,
                         duration=round(time.monotonic() - t0, 6), **switch.phases)

    def _build_at(self, position: Position) -> Any:
        """`build()` in a new generation, where the user's build reads run.rank."""
        self._move(position)
        return self._build_view()

    def _sync_shards(self, plan: Plan, committed_step: int, holds_state: bool) -> SyncResult:
        """The state step of a sharded switch (`ShardedSync`): this rank's shard at the step
        every shard is held at, from itself, a replica or a buddy's snapshot."""
        tracked = self.tracked
        result = self._sharded.sync(plan.rank, plan.world_size, committed_step, holds_state,
                                    torn=lambda: setattr(tracked, "whole", False))
        tracked.whole = True
        shard_plan = self._sharded.plan
        self.events.emit(Event.SHARD_SYNC, gen=plan.gen, step=result.step,
                         committed=committed_step if holds_state else None,
                         restored=plan.rank in shard_plan.restore,
                         source=result.source, received_bytes=result.received_bytes,
                         transfers=[[t.src, t.dst, t.live] for t in shard_plan.transfers])
        return result

    def _checkpoints_formed(self, plan: Plan, groups: CheckpointGroups | None,
                            step: int) -> None:
        """In a new generation: checkpoint over its groups, on a schedule its members agree."""
        if self.checkpointer is not None:
            self.checkpointer.use_groups(groups and groups.writes, groups and groups.control,
                                         plan.gen)
            self.checkpointer.rejoin(step)

    def _exit(self) -> None:
        """This worker is not needed (the job ended, or a spare took its rank): exit 0."""
        self.close()
        self.events.close()
        sys.exit(0)

    def close(self) -> None:
        """Stop the engine's threads and tear down what it formed; safe to call twice."""
        if self._sharded is not None and not self._sharded.close(timeout=30.0):
            # A daemon thread: it dies with the process. Said, not waited for.
            print("unbroken: an in-memory snapshot round was still running at close",
                  file=sys.stderr)
        if self._watchdog is not None:
            self._watchdog.stop()
            for error in self._watchdog.errors:
                print(f"unbroken: the watchdog thread failed: {error}", file=sys.stderr)
            self._watchdog = None
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
