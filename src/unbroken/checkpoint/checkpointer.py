"""Async, atomic, verified DCP checkpoints: staged at a step boundary, persisted behind it.

    ckpt.protect(model, optimizers)     # their step pre-hook waits for an unfinished copy
    ckpt.start(state, step)             # collective; returns in about a millisecond
    ...the next step's forward and backward run while the state is copied...
    ...training goes on while the copy is written, fsynced, hashed and committed...

At most one save is in flight. When the next falls due before the last is committed, it is
deferred, not waited for: training goes on and the save is retried after 1, 2, 4, ... steps
(`checkpoint_deferred`). Whether to save is agreed by all ranks on a control group of its
own (a save is collective, and only some ranks might still be busy), and the writes go over
another; neither is the training group. A failed save (a full disk, a dead writer, a peer
that died) is recorded as `checkpoint_failed` and the previous checkpoint stays the latest;
the next one is tried on schedule. A writer that takes longer than `persist_timeout` is
reported (`checkpoint_stuck`) and skipped over; the loop never waits on it. A checkpoint_dir
that is not shared by every node (each host's own disk at that path) is refused before the
first commit, and at every save after it: said once in one line on stderr, and recorded
(`checkpoint_dir_not_shared`, then `checkpoint_failed` for each save); training goes on.

A save may be marked `verified` (the data-parallel replicas' checksums agreed at its step) or
not (they disagreed: silent data corruption); the mark goes into its manifest, and a restart
passes over checkpoints marked unverified when a verified one is there (see `loader.choose`).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from unbroken.checkpoint.interval import Schedule
from unbroken.checkpoint.layout import committed_checkpoints, remove_torn, step_name, temporary_dir
from unbroken.checkpoint.loader import choose, describe_dcp_failure, load_into
from unbroken.checkpoint.persist import (
    CheckpointDirNotShared,
    CheckpointWriteError,
    Committed,
    exchange_json,
    persist,
)
from unbroken.checkpoint.staging import HostImage, Staged, StagingArea, local_tensor
from unbroken.checkpoint.writers import Replicated, assign, digest, fill, replicated
from unbroken.errors import first_line
from unbroken.telemetry import schema as ev

__all__ = ["Checkpointer", "CheckpointWriteError", "committed_checkpoints"]

# DCP warns on every single-process save/load; a single process is a supported use here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class _Save:
    """One save in flight."""

    step: int
    staged: Staged
    started: float  # monotonic, when the loop called start()
    kickoff: float = 0.0  # seconds start() took
    copied: threading.Event = field(default_factory=threading.Event)
    copied_at: float = 0.0
    wait_began: float | None = None  # when the loop began waiting for the copy
    done: threading.Event = field(default_factory=threading.Event)
    committed: Committed | None = None
    error: str | None = None
    persisted: float = 0.0  # seconds from the end of the copy to the commit
    write_rate: float | None = None  # bytes/s the data files are paced to
    stuck_reported: bool = False
    abandoned: bool = False  # its groups were torn down by a generation switch
    not_shared: CheckpointDirNotShared | None = None  # rank 0: refused, checkpoint_dir not shared
    image: HostImage | None = None  # a host copy taken by others, persisted from in place
    copy_ok: bool = False  # the staged copy is whole (a rollback may restore it)
    area: StagingArea | None = None  # an abandoned save's staging, closed when it ends
    verified: bool | None = None  # the replicas agreed at `step`; None: not checked

    @property
    def stall(self) -> float:
        """What this save cost the training loop: start() plus any wait for the copy."""
        waited = max(0.0, self.copied_at - self.wait_began) if self.wait_began else 0.0
        return self.kickoff + waited


class Checkpointer:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        keep: int = 3,
        keep_every: int | None = None,
        attempt: int = 0,
        record: ev.Emit | None = None,
        clean_stale: bool = True,
        persist_timeout: float = 600.0,
        schedule: Schedule | None = None,
        fault_point: Callable[[str, int], None] = lambda point, step: None,
        available_memory: Callable[[], int] | None = None,
    ) -> None:
        """`group` carries the writes, `control_group` the decision to save (both gloo, and
        never the training group). `clean_stale`: remove torn saves of earlier attempts
        (rank 0); a replacement joining a running job must not, the others may be saving.
        `available_memory`: this rank's host memory, which the staged copy must fit."""
        if keep < 1:
            raise ValueError("keep must be at least 1")
        if keep_every is not None and keep_every < 1:
            raise ValueError("keep_every must be at least 1")
        self.directory = Path(directory)
        self.group = group
        self.control_group = control_group if control_group is not None else group
        self.keep = keep
        self.keep_every = keep_every
        self.attempt = attempt
        self.record: ev.Emit = record or (lambda event: None)
        self.persist_timeout = persist_timeout
        self.schedule = schedule or Schedule()
        self.fault_point = fault_point  # injected faults in the writer (tests)
        self.tag = f"a{attempt}"  # names this writer's temporary directories
        self.available_memory = available_memory
        self._staging = StagingArea(available_memory)
        self._save: _Save | None = None
        self._deferrals = 0
        self._loaded_step: int | None = None
        self._last: _Save | None = None  # the last save that finished, for the schedule
        self._hooks: list[Any] = []
        self._protected: tuple[torch.nn.Module | None, list[torch.optim.Optimizer]] = (None, [])
        self._said_not_shared = False  # the one line for a checkpoint_dir that is not shared
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.rank == 0 and clean_stale:
            remove_torn(self.directory)

    @property
    def rank(self) -> int:
        """This process's rank now: in-place recovery renumbers ranks between generations."""
        return dist.get_rank() if dist.is_initialized() else 0

    def use_groups(self, group: dist.ProcessGroup | None, control_group: dist.ProcessGroup | None,
                   generation: int) -> None:
        """Checkpoint over a new generation's groups; its saves get temporary dirs of their own.

        A save still in flight on the old groups cannot commit any more (they were aborted),
        so it is reported failed and abandoned here. Its writer usually fails at once on the
        aborted sockets, but one whose collective was still queued when the group was
        destroyed waits out the group's timeout; it must not hold the next saves back. Its
        writer removes its temporary dir when it ends (a new rank 0 removing it could race
        that writer's commit).
        """
        self.group, self.control_group = group, control_group
        self.tag = f"a{self.attempt}g{generation}"
        save = self._save
        if save is not None and not save.done.is_set():
            save.abandoned = True
            self._save = None
            save.area = self._staging  # its writer may still read it: closed when it ends
            self._staging = StagingArea(self.available_memory)
            self.record(ev.CheckpointFailed(step=save.step, stall=round(save.stall, 6),
                        duration=round(time.monotonic() - save.started, 6),
                        error=f"abandoned: generation {generation} formed while it was written"))

    # ------------------------------------------------------------------ staging
    def protect(self, model: torch.nn.Module | None, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Copy `model`'s parameters and the optimizers' state in the background, and make
        each optimizer's update wait until that copy is done (a step pre-hook)."""
        optimizers = list(optimizers)
        self._protected = (model, optimizers)
        for handle in self._hooks:
            handle.remove()
        self._hooks = [o.register_step_pre_hook(lambda *_: self.wait_staged()) for o in optimizers]

    def _late(self) -> Callable[[torch.Tensor], bool]:
        """Tensors that only an optimizer update changes: safe to copy after start() returns.

        The parameters the protected optimizers update, and their state; not every parameter
        of the model (a momentum encoder's are updated in place by the forward pass)."""
        _, optimizers = self._protected
        ptrs: set[int] = set()
        for optimizer in optimizers:
            ptrs.update(local_tensor(p).data_ptr() for group in optimizer.param_groups
                        for p in group["params"])
            for per_param in optimizer.state.values():
                ptrs.update(local_tensor(v).data_ptr() for v in per_param.values()
                            if isinstance(v, torch.Tensor))
        return lambda t: t.numel() > 0 and t.data_ptr() in ptrs

    def wait_staged(self) -> None:
        """Block until the state being checkpointed has been copied (before it changes)."""
        save = self._save
        if save is None or save.copied.is_set():
            return
        save.wait_began = time.monotonic()
        save.copied.wait()

    # ------------------------------------------------------------------ saving
    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    @property
    def in_flight(self) -> bool:
        return self._save is not None and not self._save.done.is_set()

    def _agree(self, busy: bool, proposal: int, layout: int = 0) -> tuple[bool, int, bool]:
        """(is any rank still writing, the largest proposed interval, do all ranks hold the
        same replicated tensors: `writers.digest`), the same on every rank."""
        vote = torch.tensor([int(busy), proposal, layout, -layout], dtype=torch.int64)
        if dist.is_initialized() and self.control_group is not None:
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.control_group)
        return bool(vote[0]), int(vote[1]), int(vote[2]) == -int(vote[3])

    def _writers(self, state: dict[str, Any]) -> tuple[list[Replicated], int]:
        """The state's replicated tensors and their digest; none in a world of one writer."""
        world = dist.get_world_size(self.group) if dist.is_initialized() and self.group is not None else 1
        items = list(replicated(state)) if world > 1 else []
        return items, digest(items) if items else 0

    def start(self, state: dict[str, Any], step: int, step_time: float | None = None,
              image: HostImage | None = None, verified: bool | None = None) -> bool:
        """Checkpoint `state` as of `step`: stage a copy now, persist it in the background.

        Collective (every rank calls it at the same step). Returns False if the save was
        deferred because a previous one is still being written on some rank. `image`: a
        host copy of the tensors at `step` that someone else takes (a sharded job's own
        in-memory copy); what it holds is persisted from it, not copied again, and it is
        released when the writer is done (or at once, if the save is deferred or raises).
        `verified`: whether the data-parallel replicas' checksums agreed at `step` (False:
        they disagreed, silent data corruption), written into the manifest as `"verified"`;
        None (not checked) leaves the key out, as in manifests written before it existed.
        """
        try:
            started = self._start(state, step, step_time, image, verified)
        except BaseException:
            if image is not None:
                image.release()
            raise
        if not started and image is not None:
            image.release()
        return started

    def _start(self, state: dict[str, Any], step: int, step_time: float | None,
               image: HostImage | None, verified: bool | None) -> bool:
        t0 = time.monotonic()
        busy = self.in_flight
        if busy:
            self._report_stuck(self._save, t0)
        elif self._save is not None:
            self._last, self._save = self._save, None
        last = self._last
        proposal = self.schedule.propose(step_time, last.stall if last else None,
                                         last.persisted if last and last.committed else None)
        items, layout = self._writers(state)
        anyone_busy, interval, same = self._agree(busy, proposal, layout)
        if anyone_busy:
            self._deferrals += 1
            self.schedule.deferred(step, self._deferrals)
            self.record(ev.CheckpointDeferred(step=step, retry_at=self.schedule.next_due,
                        writing=self._save.step if busy else None))
            return False
        changed = interval != self.schedule.interval or self._last is None
        self.schedule.reset(step, interval)
        if changed and self.rank == 0:
            self.record(ev.CheckpointInterval(steps=interval, reason=self.schedule.reason))
        self._deferrals = 0
        stage_error = None
        writers = assign(items, dist.get_world_size(self.group)) if items and same else {}
        me = dist.get_rank(self.group) if writers else 0
        leave_out = frozenset(path for path, rank in writers.items() if rank != me)
        try:
            staged = self._staging.stage(state, self._late(), image, leave_out)
            staged.writers, staged.items = writers, {it.path: it for it in items}
        except Exception as exc:  # noqa: BLE001 -- no memory for the buffers, an uncopyable value
            staged, stage_error = Staged(state={}), first_line(exc)  # the peers must hear of it
        save = _Save(step=step, staged=staged, started=t0, image=image, verified=verified)
        # Spread the disk writes over about one step (see direct_io.py): a step's worth of
        # delay to durability, for a few percent of each step instead of a stutter of one.
        save.write_rate = staged.nbytes / step_time if step_time and staged.nbytes else None
        self._save = save
        group, tmp = self.group, temporary_dir(self.directory, step, self.tag)
        save.kickoff = time.monotonic() - t0
        threading.Thread(target=self._background, args=(save, group, self.rank, tmp, stage_error),
                         daemon=True, name=f"unbroken-checkpoint-{step}").start()
        return True

    def _report_stuck(self, save: _Save, now: float) -> None:
        if not save.stuck_reported and now - save.started > self.persist_timeout:
            save.stuck_reported = True
            self.record(ev.CheckpointStuck(step=save.step, seconds=round(now - save.started, 3),
                        timeout=self.persist_timeout))

    def _background(self, save: _Save, group: dist.ProcessGroup | None, rank: int,
                    tmp: Path, error: str | None) -> None:
        """The checkpoint thread: finish the copy, then write and commit it."""
        try:
            self._write_and_commit(save, group, rank, tmp, error)
        finally:
            save.copied.set()  # whatever happened, never leave the loop or the vote waiting
            if save.image is not None:
                save.image.release()
            if save.area is not None:
                save.area.close()  # abandoned: nothing reads its pinned buffer any more
            save.done.set()

    def _write_and_commit(self, save: _Save, group: dist.ProcessGroup | None, rank: int,
                          tmp: Path, error: str | None) -> None:
        t0 = time.monotonic()
        try:
            if error is None:
                self._staging.copy_pending(save.staged)
            if error is None and save.image is not None:
                why = save.image.wait()
                if why is not None:
                    error = f"the in-memory copy of step {save.step} failed: {why}"
            save.copy_ok = error is None
        except Exception as exc:  # noqa: BLE001 -- reported to every rank below
            error = first_line(exc)
        finally:
            save.copied_at = time.monotonic()
            save.copied.set()
        t1 = time.monotonic()  # t0 to t1: the staged copy (the event's `snapshot`)
        try:
            if error is None:
                try:  # before any collective, so that a failure here is reported, not a hang
                    tmp.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    error = f"rank {rank}: {first_line(exc)}"
            distributed = dist.is_initialized() and group is not None
            reports = exchange_json({"ok": error is None, "error": error},
                                    group if distributed else None)
            failed = [r["error"] for r in reports if not r["ok"]]
            if failed:
                raise CheckpointWriteError(f"staging failed: {failed[0]}")
            extra: dict[str, Any] = {"attempt": self.attempt}
            if save.verified is not None:
                extra["verified"] = save.verified
            save.committed = persist(
                save.staged.state, save.step, tmp, self.directory / step_name(save.step), group,
                rank, self.keep, self.keep_every, extra,
                before_commit=lambda: self.fault_point("persist", save.step),
                write_rate=save.write_rate)
        except CheckpointException as exc:  # DCP's, a BaseException: a peer failed inside DCP
            save.error = describe_dcp_failure(exc)
        except CheckpointDirNotShared as exc:  # rank 0; the others get CheckpointWriteError
            save.error, save.not_shared = first_line(exc), exc
        except Exception as exc:  # noqa: BLE001 -- reported; the next save is tried on schedule
            save.error = first_line(exc)
        finally:
            if save.committed is None and rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # torn: give its space back
            end = time.monotonic()
            save.persisted = end - t1
            if save.image is not None:
                save.staged.state = {}  # views of a copy its owner overwrites later
            self._report(save, t0, t1, end)

    def _report(self, save: _Save, t0: float, t1: float, end: float) -> None:
        if save.abandoned:
            return  # reported when it was abandoned
        try:
            if save.committed is not None:
                c = save.committed
                durable = (c.committed_at or end) - save.started  # retention's deletes after
                self.record(ev.CheckpointSaved(step=save.step, path=str(c.path), bytes=c.bytes,
                            stall=round(save.stall, 6), snapshot=round(t1 - t0, 6),
                            persist=round(end - t1, 6), durable=round(durable, 6),
                            deleted=c.deleted or None, retention_error=c.retention_error,
                            staged_bytes=save.staged.nbytes, pinned_bytes=save.staged.pinned))
            else:
                if save.not_shared is not None and not self._said_not_shared:
                    self._say_not_shared(save.step, save.not_shared)
                self.record(ev.CheckpointFailed(step=save.step, error=save.error,
                            stall=round(save.stall, 6), duration=round(end - save.started, 6)))
        except Exception as exc:  # noqa: BLE001 -- the event log is gone (closed, disk full)
            print(f"unbroken: checkpoint of step {save.step}: could not record the outcome "
                  f"({first_line(exc)}); committed: {save.committed is not None}",
                  file=sys.stderr, flush=True)

    def _say_not_shared(self, step: int, exc: CheckpointDirNotShared) -> None:
        """Once per process, not per save: every later save is refused the same way."""
        self._said_not_shared = True
        print(exc.line(), file=sys.stderr, flush=True)
        self.record(ev.CheckpointDirNotShared(step=step, path=exc.directory,
                    unseen=len(exc.unseen), files=exc.files,
                    examples=[u.describe() for u in exc.unseen[:3]]))

    def host_copy(self) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest save's staged copy, whole, in this checkpointer's own
        buffers; None if there is none. It stays valid until the next `start` (which reuses
        the buffers): a replicated job's rollback restores it with no storage read. Waits
        for a copy in progress first. Main thread."""
        self.wait_staged()
        save = self._save
        if save is None or not save.copy_ok or save.image is not None or not save.staged.state:
            return None
        return save.step, save.staged.state

    def fill_left_out(self, state: dict[str, Any]) -> dict[str, Any]:
        """`host_copy()`'s state made whole (collective on the control group, after every
        rank agreed on its step): each replicated tensor left to another writer is
        broadcast from that writer's copy (`writers.fill`)."""
        staged = self._save.staged if self._save is not None else Staged(state={})
        if not staged.writers:
            return state
        return fill(state, staged.writers, staged.items, dist.get_rank(self.group),
                    lambda t, w: dist.broadcast(t, src=dist.get_global_rank(self.group, w),
                                                group=self.control_group))

    def agree_step(self, step: int) -> bool:
        """True if every rank passes the same `step` (collective on the control group)."""
        bounds = torch.tensor([step, -step], dtype=torch.int64)
        if dist.is_initialized() and self.control_group is not None:
            dist.all_reduce(bounds, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(bounds[0]) == -int(bounds[1]) == step

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight (if any) to finish; False if it is still running."""
        save = self._save
        if save is None:
            return True
        return save.done.wait(timeout)

    def save(self, state: dict[str, Any], step: int, verified: bool | None = None) -> Path:
        """Checkpoint `state` and wait until it is committed (collective). `verified`: as
        for `start`."""
        self.wait(self.persist_timeout)
        if not self.start(state, step, verified=verified):
            raise CheckpointWriteError(f"a save of step {self._save.step} is still being written")
        self.wait()
        save = self._save
        if save.committed is None:
            raise CheckpointWriteError(save.error or "checkpoint failed")
        return save.committed.path

    def finish(self, state: dict[str, Any], step: int, verified: bool | None = None) -> bool:
        """At the end of training: commit the final state, waiting at most `persist_timeout`.
        Collective. False (and an event) if it could not be committed in time. `verified`:
        as for `start`, for a save started here (one of `step` already committed keeps its
        own mark)."""
        t0 = time.monotonic()
        if not self.wait(self.persist_timeout):
            self._report_stuck(self._save, time.monotonic() + self.persist_timeout)
        save = self._save
        have = (save.step == step and save.committed is not None) if save is not None \
            else step == self._loaded_step  # a checkpoint loaded and nothing run since
        # Agreed, not decided per rank: a rank whose wait ran out just before its save
        # committed must not start a save that the others skip.
        anyone_busy, anyone_lacks, _ = self._agree(self.in_flight, int(not have))
        if not anyone_lacks:
            return True
        if anyone_busy:
            self.record(ev.CheckpointFailed(step=step, final=True,
                        error="the previous save was still being written after checkpoint_timeout"))
            return False
        if not self.start(state, step, verified=verified):
            return False  # cannot happen after the vote above, but never start twice
        left = max(0.0, self.persist_timeout - (time.monotonic() - t0))
        if not self.wait(left):
            self._report_stuck(self._save, time.monotonic() + self.persist_timeout)
            return False
        return self._save.committed is not None

    def rejoin(self, step: int) -> None:
        """After a generation switch: agree afresh on when the next save is due (collective).
        A replacement has no schedule of its own yet; every member's is reset alike."""
        proposal = self.schedule.interval
        _, interval, _ = self._agree(False, proposal)
        self._deferrals = 0
        self.schedule.reset(step, interval)

    # ------------------------------------------------------------------ loading
    def load_latest(self, state: dict[str, Any] | Callable[[], dict[str, Any]]) -> int | None:
        """Load the newest intact checkpoint into `state` in place; its step, or None if none.
        When some intact checkpoint is marked verified, newer ones marked unverified are
        passed over (`checkpoint_invalid`; see `loader.choose`).

        `state` may be a function that builds the state dict: it is called only once a
        checkpoint is chosen. Building an optimizer's state dict initialises a fresh
        optimizer's state (DCP takes a zero-learning-rate step, which counts), so a job with
        nothing to load must not build it, or it would train differently from the same job
        without a checkpoint_dir."""
        t0 = time.monotonic()
        path = choose(self.directory, self.rank, self.control_group, self.record)
        if path is None:
            return None
        load_into(state() if callable(state) else state, path, self.group)
        step = int(path.name.removeprefix("step_"))
        self.schedule.reset(step)
        self._loaded_step = step
        self.record(ev.CheckpointLoaded(step=step, path=str(path),
                    duration=round(time.monotonic() - t0, 6)))
        return step
