"""The recovery engine: the step transaction that any training loop drives.

`run.train` is one client; framework adapters are others. The contract (the order of calls,
which are collective, what may raise) is in docs/engine.md. In short, per step:

    step = engine.begin()            # None: done. A due switch happens here first.
    try:
        engine.enter(step)           # injected faults, the step's RNG seed
        ...forward and backward...   # the loop's own work, on `engine.view`
        verdict = engine.check(step, metrics)  # anomalies; not COMMIT: the engine handled it
    except Exception as exc:
        engine.fail(step, exc)       # in place: leave, join, sync, rebuild; else raises
        continue
    if verdict is not Verdict.COMMIT:
        continue
    with engine.updating():          # or engine.tracked.update(): the tracked optimizers
        optimizer.step()
    engine.commit(step, metrics)     # the step is committed; checkpoints and snapshots

The engine holds the worker's `Position` and replaces it in one place (`_move`). Its
collaborators (events, heartbeat, faults, checkpointer, generations) are passed in: fakes
can stand in.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import torch.distributed as dist

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
from unbroken.runtime import spare, step_probe
from unbroken.runtime.anomalies.anomaly_duty import AnomalyDuty
from unbroken.runtime.anomalies.numerics import Verdict
from unbroken.runtime.checkpoint_duty import CheckpointDuty
from unbroken.runtime.config import EngineSettings
from unbroken.runtime.generations.fence import Fence, unfenceable
from unbroken.runtime.generations.recovery import Generations
from unbroken.runtime.generations.release import forget_frames
from unbroken.runtime.generations.watchdog import NO_WATCHDOG, Watchdog, watch
from unbroken.runtime.groups.process_group import AbortableGroups, nccl_errors
from unbroken.runtime.groups.world import is_fake_world, is_sharded
from unbroken.runtime.heartbeat import (
    PHASE_CHECKPOINT,
    PHASE_DONE,
    PHASE_RECOVERY,
    PHASE_STARTING,
    PHASE_TRAINING,
    HeartbeatWriter,
)
from unbroken.runtime.position import Position
from unbroken.runtime.progress import ProgressMarks, seed_step
from unbroken.runtime.switching import NotNeeded, Switcher
from unbroken.runtime.tracked import TrackedState
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EventLog

if TYPE_CHECKING:  # the checkpointer imports DCP (and DTensor): only a job with checkpoints
    from unbroken.checkpoint.checkpointer import Checkpointer


class Engine:
    """One worker's recovery engine. Main thread only, except the watchdog's abort."""

    def __init__(self, position: Position, settings: EngineSettings, *, events: EventLog,
                 faults: FaultInjector, groups: AbortableGroups,
                 heartbeat: HeartbeatWriter | None = None, checkpointer: Checkpointer | None = None,
                 generations: Generations | None = None,
                 available_memory: Callable[[], int] = lambda: 0,
                 file_drain: Callable[[int], bool] | None = None) -> None:
        """`generations` is required for in-place recovery (`settings.in_place`). `file_drain(slot)`
        asks the leader to move a slot onto a spare (the straggler remedy)."""
        self.settings = s = settings
        self.events, self.faults, self.groups, self.heartbeat = events, faults, groups, heartbeat
        self.generations = generations
        self.checkpoints = CheckpointDuty(checkpointer)
        self.switcher = (Switcher(generations, s, events.emit, self.checkpoints)
                         if generations is not None else None)
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
        self._watchdog: Watchdog = NO_WATCHDOG
        self._marks = ProgressMarks(heartbeat)
        self._t0 = 0.0
        self._pending: ev.Step | None = None  # a committed step's event, until `settle`
        self.anomalies = AnomalyDuty(s.anomalies, events.emit, file_drain)
        self.fence = Fence(lambda: self._position, lambda gen: self._watchdog.aborted(gen),
                           nccl_errors, lambda *at: faults.at_point("update", *at))

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
        """Register the state a step commits (before `start`)."""
        self.tracked = tracked
        tracked.extra.update(self.anomalies.extras())
        self.checkpoints.protect(tracked)

    def need_tracked(self, what: str) -> TrackedState:
        """The tracked state; a `UserError` naming `what` needed it if nothing is tracked."""
        if self.tracked is None:
            raise UserError(f"call run.track(model, optimizer) before {what}")
        return self.tracked

    def resume(self) -> None:
        """Load the newest checkpoint, if any (collective over the checkpoint's groups)."""
        if self.checkpoints.checkpointer is None:
            return
        self.stamp(self._position.step, PHASE_CHECKPOINT)
        step = self.checkpoints.load_newest(self.need_tracked("resuming"), self._position.step)
        if step is not None:
            self._move(self._position.moved(step=step, holds_state=True))
        self.stamp(self._position.step, PHASE_TRAINING)

    # ------------------------------------------------------------------ the transaction
    def start(self, last_step: int, build: Callable[[], Any] | None,
              shadow_step: Callable[[int, Any], Any], resumed_at: int = 0) -> None:
        """Enter the job for a resilient loop up to `last_step` (collective): resume from the
        checkpoint, or (a spare) warm up, wait for promotion and join, or (a replacement)
        join. `build()` makes the view a step runs on (once per generation); `shadow_step`
        is the loop's step, which a spare runs in its sandbox. `resumed_at`: the committed
        step a loop that resumed itself (a framework from its own checkpoint) stands at;
        a joiner's comes from its peers instead. May exit the process (0): a spare or
        replacement that the job never needed."""
        tracked = self.need_tracked("run.train()")
        self._build, self._last_step, self._resilient = build, last_step, True
        self._move(self._position.moved(holds_state=not self.joining,
                                        step=self._position.step if self.joining else resumed_at))
        if self.in_place and is_sharded(tracked.model):
            local = max(1, self.settings.local_world)
            why = self.switcher.prepare_sharded(tracked, self._position, self.joining,
                                                self.groups, self._available_memory() // local,
                                                lambda line: _say(self._position, line))
            if why is not None:
                self.in_place_unavailable(why)
        if self.settings.spare:
            self._enter_as_spare(shadow_step)
            self._join("spare")
        elif self.joining:
            self._join("replacement")
        else:
            self.resume()
            self.view = self._build_at(self._position)
            why = self.switcher.check(tracked, self._position) if self.in_place else None
            if why is not None:
                self.in_place_unavailable(why)
        pos = self._position
        self.events.emit(ev.Resume(step=pos.step, total=last_step, gen=pos.gen))
        if self.anomalies.config.any and pos.rank == 0:
            self.events.emit(self.anomalies.describe())
        if self.in_place and (why := unfenceable(tracked.optimizers, tracked.model)):
            self.in_place_unavailable(why)
        tracked.fence = self.fence if self.in_place else None
        if self.heartbeat is not None and self.in_place:
            self.heartbeat.set_generation(pos.gen)
            self._watchdog = self.generations.watchdog = watch(
                self.heartbeat, self.groups.interrupt, self.events.emit,
                self.settings.node_dir, lambda: self._position.rank)

    def start_plain(self, last_step: int) -> None:
        """Enter the job for a loop that steps the optimizer itself, up to `last_step`:
        resume from the checkpoint. No in-place recovery: a fault restarts every worker."""
        if self.checkpoints.checkpointer is not None:
            self.need_tracked("run.steps() to checkpoint")
        self._last_step = last_step
        self.resume()
        self.events.emit(ev.Resume(step=self._position.step, total=last_step))

    def begin(self) -> int | None:
        """The step to run next, or None when the run is done. Between steps; a switch the
        leader asked for happens here first (collective, like the step)."""
        while (step := self._position.step) < self._last_step:
            self.stamp(step, PHASE_TRAINING)
            if (self._resilient and self.in_place and self.heartbeat is not None
                    and self.heartbeat.switch_asked(self._position.gen, step)):
                self._join(LeaveReason.SWITCH)
                continue
            self._t0 = time.perf_counter()
            self._watchdog.entered(self._position.gen, step)
            step_probe.take()  # a mark left by a step that did not commit
            reason = self.anomalies.skip_reason(step)
            if reason is None:
                return step
            self.skip(step, reason)
        return None

    def enter(self, step: int) -> None:
        """Inside the step, first: injected faults fire here, and the RNG is seeded."""
        self.faults.at_step(step, self.step_time)
        if self._resilient and self.settings.seed is not None:
            seed_step(self.settings.seed, step, self.slot)
        elif self.anomalies.numerics_on:  # a rerun draws the same numbers as this run
            self.anomalies.save_rng()

    def check(self, step: int, metrics: dict[str, Any] | None = None) -> Verdict:
        """After backward, before the update: judge the loss (`metrics["loss"]`) and the
        gradients (collective when numerical checks are on). Anything but `COMMIT` was carried
        out here (`RERUN`, `SKIPPED`, `ROLLED_BACK`): the loop goes on to `begin()`. Raises
        `JobStopped` on every rank when too many anomalies came in a window (docs/engine.md)."""
        metrics = {} if metrics is None else metrics
        faults = self.faults
        if not (self.anomalies.numerics_on or faults.has("nan") or faults.has("spike")):
            return Verdict.COMMIT
        params = list(self.need_tracked("a check").model.parameters())
        faults.corrupt_gradients(step, params)
        if "loss" in metrics:
            metrics["loss"] = faults.scale_loss(step, metrics["loss"], params)
        if not self.anomalies.numerics_on:
            return Verdict.COMMIT
        pos = self._position
        decision = self.anomalies.judge(step, params, metrics, pos.gen, pos.rank)
        kind = decision.found.kind if decision.found is not None else None
        if decision.verdict == Verdict.RERUN:
            self.drop(step, f"rerun: {kind}")
            self.anomalies.restore_rng()
        elif decision.verdict == Verdict.ROLLED_BACK:
            self._watchdog.left()
            self.need_tracked("a step").discard_gradients()
            if self.rollback(f"anomaly: {kind}") is None:
                self.skip(step, f"{kind}: no copy to roll back to", metrics)
                return Verdict.SKIPPED
        elif decision.verdict == Verdict.SKIPPED:
            self.skip(step, str(kind), metrics)
        return decision.verdict

    def skip(self, step: int, reason: str, metrics: dict[str, float] | None = None) -> None:
        """Pass over `step` on this rank: its gradients are discarded, no update is made,
        and the position moves past it; then what `commit` does after its update (a due
        checkpoint, a snapshot round). Every rank must skip the same step."""
        self.need_tracked("a step").discard_gradients()
        self._move(self._position.moved(step=step + 1, holds_state=True))
        self.events.emit(ev.StepSkipped(step=step, gen=self._position.gen if self._resilient
                                        else None, reason=reason, extra=metrics or {}))
        self.settle()

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Around an update the loop makes itself: the state is torn if it raises.
        (`engine.tracked.update()` is the tracked optimizers' update, in this block.)"""
        with self.need_tracked("an update").updating():
            yield

    def commit(self, step: int, metrics: dict[str, float] | None = None,
               settle: bool = True) -> None:
        """After the update of `step`: it is committed, then `settle()`; unless `settle` is
        False (a loop whose step goes on after its update, `runtime/own_loop`: it settles)."""
        ended = time.perf_counter()
        duration = ended - self._t0
        if self.anomalies.stragglers is not None:
            self.anomalies.stragglers.record(self._t0, ended, self._position.gen)
        if self.faults.has("bitflip"):
            self.faults.corrupt_update(step, list(self.need_tracked("a commit").model.parameters()))
        self._move(self._position.moved(step=step + 1, holds_state=True))
        self._pending = ev.Step(step=step, duration=round(duration, 6),
                                extra={} if metrics is None else metrics,  # filled until settle
                                gen=self._position.gen if self._resilient else None)
        avg = self.step_time
        self.step_time = duration if avg is None else 0.9 * avg + 0.1 * duration
        if settle:
            self.settle()

    def settle(self, collectives: bool = True) -> None:
        """After a commit: its event, a due checkpoint or snapshot round, the final checkpoint
        after the last step (collective); a peer's fault met here is recovered in place.
        `collectives=False`: the event only (a fault after the commit was recovered)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.events.emit(pending)
        if not collectives:
            return
        pos = self._position
        try:
            try:
                due = self.checkpoints.due(pos.step)
                sharded = self.switcher.sharded if self.switcher is not None else None
                verdict = self.anomalies.after_commit(  # replicas checked before any copy
                    pos, self.slot, sharded.shards.shard_index(pos.rank) if sharded
                    else -int(is_sharded(self.tracked.model)),
                    self.settings.node, self.tracked, self.step_time,
                    self.checkpoints.interval, self.checkpoints.copies(pos.step, self._last_step))
                if verdict is not None:
                    restored = verdict.rollback and self.rollback("silent data corruption")
                    if error := verdict.error(self.slot, pos.step, restored is not None):
                        raise error
                    if verdict.rollback:
                        return
                # A sharded job's round first: a checkpoint persists from its host copy.
                image = (self.switcher.after_commit(pos.step, self._last_step, self.step_time,
                                                    due, self.checkpoints.interval)
                         if self.switcher is not None else None)
                self.checkpoints.after_commit(self.tracked, pos.step, self.step_time, image,
                                              verdict.clean if verdict is not None else None)
                if self._resilient and pos.step == self._last_step:
                    self.finish(checkpoint=True, done=False)
            finally:
                self._watchdog.left()
        except Exception as exc:
            if not (self._resilient and self.in_place and is_peer_error(exc)):
                raise
            self._join(LeaveReason.PEER, error=first_line(exc))

    def fail(self, step: int, exc: Exception) -> None:
        """The step raised `exc`. In place: the step is dropped, and this worker leaves the
        generation and joins the next one with the newest state. Re-raises `exc` when that
        cannot help: not in place, or this process's own device is broken."""
        self._watchdog.left()
        kind = classify(exc, current_device())
        if not self.in_place or kind == ErrorClass.STOP:
            raise exc
        self.need_tracked("a step").discard_gradients()
        forget_frames(exc)  # the failed step's locals (activations, the old view) let go
        if kind == ErrorClass.PEER:
            self._join(LeaveReason.PEER, error=first_line(exc))
            return
        error = f"{type(exc).__name__}: {exc}"
        tb = "".join(traceback.format_exception(exc))[-4000:]
        self.events.emit(ev.StepFailed(step=step, gen=self._position.gen, error=error,
                                       traceback=tb, error_class=kind.value))
        if kind == ErrorClass.OWN_DEVICE:
            # Its CUDA context is broken for good: this process dies (its agent reports the
            # death) and a fresh one takes the rank, while the survivors go on in place.
            raise exc
        self._join(LeaveReason.EXCEPTION, error=error, traceback=tb)

    def drop(self, step: int, reason: str) -> None:
        """Give up `step` before its update: nothing is committed and the step runs again
        (with the same seed). Local; every rank must drop the same step."""
        self._watchdog.left()
        self.need_tracked("a step").discard_gradients()
        self.events.emit(ev.StepDropped(step=step, gen=self._position.gen, reason=reason))

    def rollback(self, reason: str) -> int | None:
        """Go back to the newest host copy of the state (RNG state included), else to the
        newest checkpoint (collective: every rank, between steps); the step resumed from, or
        None (and nothing changes) when there is neither (docs/engine.md)."""
        start = self._position.step
        step, source = self.checkpoints.roll_back(
            self.need_tracked("a rollback"),
            self.switcher.sharded if self.switcher is not None else None, start)
        if step is None:
            return None
        self._move(self._position.moved(step=step, holds_state=True))
        self.events.emit(ev.RolledBack(step=step, from_step=start, reason=reason,
                                       restored_from=source))
        return step

    def finish(self, checkpoint: bool = False, done: bool = True) -> None:
        """After the last step: the final checkpoint (`checkpoint`: committed before we
        report done, bounded by checkpoint_timeout), then (`done`) report done (first: a
        done heartbeat means the leader counts this member done) and stamp the heartbeat."""
        pos = self._position
        if checkpoint and self.checkpoints.checkpointer is not None:
            self.stamp(pos.step, PHASE_CHECKPOINT)
            self.checkpoints.finish(self.need_tracked("checkpointing"), pos.step)
        if not done:
            return
        if self._resilient and self.in_place:
            self.generations.membership.report_done(pos.gen)
        self.stamp(pos.step, PHASE_DONE)
        self.events.emit(ev.TrainingDone(step=pos.step, gen=pos.gen if self._resilient else None,
                                         pid=os.getpid() if self._resilient else None))

    # ------------------------------------------------------------------ in place
    def in_place_unavailable(self, why: str) -> None:
        """Turn in-place recovery off, saying why (rank 0 prints it)."""
        why = f"{why}: a fault restarts every worker from the last checkpoint"
        self.events.emit(ev.InPlaceUnavailable(reason=why))
        _say(self._position, f"in-place recovery is not available: {why}")
        self.in_place = False

    def _build_at(self, position: Position) -> Any:
        """Stand at `position`, then make the view (the user's build reads run.rank)."""
        self._move(position)
        view = self.tracked.model
        if self._build is not None and dist.is_initialized():
            view = self._build()
        if self.anomalies.stragglers is not None:
            self.anomalies.stragglers.watch(view)
        self._marks.watch(view)
        return view

    def _enter_as_spare(self, shadow_step: Callable[[int, Any], Any]) -> None:
        """A spare's shadow steps in a world that reaches no one (then it holds nothing),
        and its wait to be promoted into a slot; exit 0 if the job ends first."""
        if self.heartbeat is None:
            raise UserError("a spare needs its agent: run it under `unbroken run --spares N`")
        t0 = time.monotonic()
        s, tracked = self.settings, self.tracked
        shards = self.switcher.sharded.shards if self.switcher.sharded is not None else None
        pos = self._position
        self._move(pos.moved(rank=0) if shards is not None else pos.moved(rank=0, world_size=1))

        def step(i: int, view: Any) -> None:
            self.stamp(i, PHASE_STARTING)
            if s.seed is not None:
                seed_step(s.seed, i, self.slot)
            shadow_step(i, view)
            tracked.update()

        detail = spare.warm_up(step, lambda: tracked.model if self._build is None
                               else self._build(), s.shadow_steps, shards)
        self._move(self._position.moved(holds_state=False))
        self.events.emit(ev.SpareReady(wid=s.wid, shadow_steps=s.shadow_steps,
                                       duration=round(time.monotonic() - t0, 6), **detail))
        slot = spare.await_promotion(self.heartbeat, self.generations.membership.finished)
        if slot is None:
            self.events.emit(ev.JoinerUnused(wid=s.wid))
            _exit_unneeded(self)
        self.slot = slot
        self._move(self._position.moved(rank=slot))
        self.events.context["slot"] = self.events.context["rank"] = slot
        self.events.emit(ev.SparePromoted(wid=s.wid, slot=slot))

    def _join(self, reason: str | LeaveReason, **detail: Any) -> None:
        """Wait for the next generation naming us; switch to it with the newest state. A
        `LeaveReason`: leave the current generation first (`detail` goes with the notice)."""
        if isinstance(reason, LeaveReason):
            pos = self._position.moved(holds_state=self._position.holds_state
                                       and self.tracked.whole)
            self._move(pos)
            self.view = None
            self.switcher.leave(pos, reason, **detail)
        self.stamp(self._position.step, PHASE_RECOVERY)
        if is_fake_world():
            dist.destroy_process_group()  # the stand-in world; the plan's replaces it
        try:
            switch = self.switcher.join(self._position, self.tracked, self._build_at,
                                        joining=self.joining, slot=self.slot,
                                        reason=str(reason))
        except NotNeeded:
            _exit_unneeded(self)  # the job ended before it needed us, or a spare took our rank
        self.joining = False
        self.anomalies.switched()
        self._move(switch.position)
        self.view = switch.view
        self.owns_group = True  # formed by the runtime: close() tears it down
        self.events.context["rank"] = switch.position.rank
        self.stamp(switch.position.step, PHASE_TRAINING)
        if self.heartbeat is not None:
            self.heartbeat.set_generation(switch.position.gen)

    def close(self) -> None:
        """Stop the engine's threads and tear down what it formed; safe to call twice."""
        if self.switcher is not None and not self.switcher.close():
            # A daemon thread: it dies with the process. Said, not waited for.
            print("unbroken: an in-memory snapshot round was still running at close",
                  file=sys.stderr)
        self._watchdog.stop()
        for error in self._watchdog.errors:
            print(f"unbroken: the watchdog thread failed: {error}", file=sys.stderr)
        self._watchdog = NO_WATCHDOG
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def _exit_unneeded(engine: Engine) -> NoReturn:
    engine.close()  # not needed (the job ended, or a spare took its rank): exit 0
    engine.events.close()
    sys.exit(0)


def _say(position: Position, line: str) -> None:
    if position.rank == 0:  # a line for the user, from rank 0
        print(f"unbroken: {line}", file=sys.stderr, flush=True)
