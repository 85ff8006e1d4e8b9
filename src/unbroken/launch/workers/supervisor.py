"""The node supervisor: spawns, watches, reaps and stops this node's workers and spares.

The processes themselves are started by `worker_spawn.WorkerSpawner` (environment, command,
logs, warm interpreters). It never touches the control store: the roles (`attempt`,
`leader`, `follower`) tell it what to start and what to promote, and publish what it observes. Its observations are typed
(`Fault`), its processes are watched through pidfds, and none of them outlives it (the
orphan guard holds their process groups).
"""

from __future__ import annotations

import itertools
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path

from unbroken.control.address import ControlAddress
from unbroken.control.heartbeat_page import PHASE_DONE, PHASE_RECOVERY, PHASE_SPARE_READY, STEPPING
from unbroken.control.messages import AttemptPlan, Fault, FaultKind, SwitchTarget
from unbroken.control.worker_env import node_dir
from unbroken.errors import PEER_ERROR_MARKERS, ErrorClass
from unbroken.launch.config import LaunchConfig
from unbroken.launch.workers.departure_relay import DepartureRelay
from unbroken.launch.workers.fork_client import ForkServer
from unbroken.launch.workers.hang_watch import HangWatch
from unbroken.launch.workers.orphan_guard import OrphanGuard
from unbroken.launch.workers.worker_logs import AttemptLogs, Tailer
from unbroken.launch.workers.worker_process import (
    WorkerProcess,
    describe_exit,
    normal_priority,
    read_error,
    signal_group,
    stop_workers,
)
from unbroken.launch.workers.worker_spawn import WorkerSpawner
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EventLog

_ROOT_CAUSE_GRACE = 0.5  # seconds to wait for a root cause when only peer errors are seen


class ExitCause(IntEnum):
    """How likely a failed worker's exit is the root cause of the attempt's end: the lowest
    is the root cause."""

    SIGNALLED = 0  # killed by a signal
    OWN_ERROR = 1  # its own error
    PEER_ERROR = 2  # an error caused by a peer (the root cause is elsewhere)


class NodeSupervisor:
    """This node's processes for one attempt at a time: workers, replacements, spares."""

    def __init__(self, cfg: LaunchConfig, events: EventLog, say: Callable[[str], None],
                 guard: OrphanGuard, forks: ForkServer | None, control: ControlAddress,
                 secret: bytes | None = None) -> None:
        self.cfg = cfg
        self.events = events
        self.say = say  # the agent's one line to the user
        self.guard = guard
        self.control = control  # where the workers reach the control plane
        self.secret = secret  # handed to the workers: they sign and check control messages
        self.node_dir = node_dir(Path(cfg.run_dir).resolve(), cfg.node_rank)
        self.workers: list[WorkerProcess] = []
        self.spares: list[WorkerProcess] = []  # warm, unassigned
        self.selector = selectors.DefaultSelector()
        self._attempt = 0
        self._plan: AttemptPlan | None = None
        self._local_rank: dict[int, int] = {}  # slot -> its local rank here
        self._incarnations: dict[int, int] = {}  # slot -> its latest replacement's number
        self._targets_written: dict[int, SwitchTarget] = {}  # pid -> the request it was given
        self._spares_started = 0
        self._spare_failures = 0
        self.hangs = HangWatch(cfg.node_rank, lambda: self.workers)  # hung workers: killed
        self._peer_errors_since: float | None = None
        self.standby = cfg.standby  # this attempt: the node runs only spares (set per plan)
        self.logs = AttemptLogs(cfg.logs, cfg.run_id, Path(cfg.run_dir).resolve() / "logs")
        self.tailer = Tailer()  # tee'd worker output, to the console with its prefix
        # In place, workers post their departures here; the attempt's watch sends them on.
        self.departures = DepartureRelay.open() if cfg.in_place else None
        if self.departures is not None:
            self.selector.register(self.departures, selectors.EVENT_READ)  # wakes `wait`
        self.spawner = WorkerSpawner(cfg, guard, forks, control, secret, self.node_dir, self.logs,
                                     self.tailer, self.departures and self.departures.path)
        # A standby node runs only spares, as many as it has devices.
        self.spare_target = (cfg.nproc_per_node if cfg.spares_when_standing_by
                             else cfg.recovery.spares)

    # ---------------------------------------------------------------- starting
    def start_attempt(self, attempt: int, plan: AttemptPlan) -> None:
        """Start this node's workers of `plan` (none on a standby node: one the plan does
        not name; a standby node that took over a lost node's ranks is named from then on)."""
        self._attempt, self._plan = attempt, plan
        self.standby = self.cfg.node_rank not in plan.nodes
        spares_here = self.cfg.nproc_per_node if self.cfg.spares_when_standing_by else 0
        self.spare_target = spares_here if self.standby else self.cfg.recovery.spares
        self.tailer.retire()  # the last attempt's logs: copied to the end, then let go
        self._targets_written.clear()
        self._peer_errors_since = None
        self.hangs.new_attempt()
        attempt_dir = self.node_dir / f"attempt_{attempt}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        for stale in attempt_dir.glob("rank_*"):  # a reused run dir: old errors or beats would lie
            if stale.suffix != ".log":
                stale.unlink(missing_ok=True)
        if self.standby:
            return
        node = plan.nodes[self.cfg.node_rank]
        for local_rank in range(node.nproc):
            rank = node.offset + local_rank
            self._local_rank[rank] = local_rank
            self._spawn_worker(rank, local_rank, f"{rank}.0", joining=False)

    def start_replacement(self, slot: int) -> WorkerProcess:
        """A fresh worker for `slot` (its previous process is dead); it joins at a step boundary."""
        t0 = time.monotonic()
        incarnation = self._incarnations.get(slot, 0) + 1
        self._incarnations[slot] = incarnation
        new = self._spawn_worker(slot, self._local_rank.get(slot, 0), f"{slot}.{incarnation}",
                                 joining=True)
        self.events.emit(ev.ReplacementStarted(slot=slot, wid=new.wid, pid=new.pid,
                         duration=round(time.monotonic() - t0, 6)))
        return new

    def _spawn_worker(self, rank: int, local_rank: int, wid: str, joining: bool) -> WorkerProcess:
        """Start one worker (`worker_spawn`) and watch it."""
        worker = self.spawner.worker(self._plan, self._attempt, rank, local_rank, wid, joining)
        if worker.pidfd is not None:
            self.selector.register(worker.pidfd, selectors.EVENT_READ, worker)
        self.workers.append(worker)
        return worker

    # ---------------------------------------------------------------- spares
    def _spawn_spare(self) -> WorkerProcess:
        """A hot spare (`worker_spawn`), watched once promoted."""
        self._spares_started += 1
        wid = f"spare{self.cfg.node_rank}-{self._spares_started}"
        # Each spare gets a device of its own, not used by a live worker or spare: on a
        # standby node the node's devices, elsewhere those beyond the workers' (LOCAL_RANK
        # nproc, nproc + 1, ...). On a GPU node without one, the spare refuses to start
        # (`Run`, one line); it keeps its device when promoted.
        taken = {p.local_rank for p in (*self.spares, *self.workers) if p.proc.poll() is None}
        local_rank = next(i for i in itertools.count() if i not in taken)
        spare = self.spawner.spare(self._plan, self._attempt, local_rank, wid)
        self.spares.append(spare)
        self.events.emit(ev.SpareStarted(wid=wid, pid=spare.pid))
        return spare

    def tend_spares(self, training: bool) -> None:
        """Replace spares that died; keep the pool at its size once training runs."""
        for spare in [s for s in self.spares if s.proc.poll() is not None]:
            self.spares.remove(spare)
            self.guard.forget(spare.pid)
            error = read_error(spare.error_file)
            detail = (f"{error['type']}: {error['message']}" if error
                      else describe_exit(spare.proc.returncode)[1])
            self.events.emit(ev.SpareLost(wid=spare.wid, exit_code=spare.proc.returncode,
                             detail=detail))
            self.say(f"spare {spare.wid} failed ({detail})")
            spare.close()
            self._spare_failures += 1
        target = self.spare_target
        if self.standby:  # a device each: spares promoted here hold theirs as workers now
            target -= sum(1 for w in self.workers if w.proc.poll() is None)
        if not training or len(self.spares) >= target:
            return
        if self._spare_failures > 3 * max(1, self.spare_target):
            return  # a script that cannot warm up as a spare: stop trying (said above)
        while len(self.spares) < target:
            self._spawn_spare()

    def ready_spares(self) -> list[WorkerProcess]:
        return [s for s in self.spares if s.proc.poll() is None
                and (b := s.heartbeat.read()) is not None and b.phase == PHASE_SPARE_READY]

    def promote(self, spare: WorkerProcess, slot: int, by: str) -> None:
        """Put a ready spare into a slot: the same rank, so nothing else moves."""
        self.spares.remove(spare)
        normal_priority(spare.pid)
        spare.rank = slot
        spare.hang = self.spawner.hang_detector()
        spare.heartbeat.promote(slot)
        self.workers.append(spare)
        if spare.pidfd is not None:
            self.selector.register(spare.pidfd, selectors.EVENT_READ, spare)
        self.events.emit(ev.SparePromoted(wid=spare.wid, slot=slot, pid=spare.pid, by=by))

    # ---------------------------------------------------------------- watching
    def wait(self, timeout: float) -> None:
        """Sleep until a watched process exits, or `timeout`."""
        self.selector.select(timeout=timeout)

    def _unwatch(self, w: WorkerProcess) -> None:
        if w.pidfd is not None and w.pidfd in self.selector.get_map():
            self.selector.unregister(w.pidfd)

    def exited(self) -> list[WorkerProcess]:
        """Workers that failed since the last look (exited non-zero, or reported an error)."""
        failed = []
        for w in list(self.workers):
            rc = w.proc.poll()
            if rc == 0:
                self._unwatch(w)
            elif rc is not None or w.error_file.exists():
                self._unwatch(w)  # or select() spins during the grace
                if w not in failed:
                    failed.append(w)
        return failed

    def finished_training(self, w: WorkerProcess) -> bool:
        """Its heartbeat says it had finished training (and, in place, reported done)."""
        beat = w.heartbeat.read()
        return beat is not None and beat.phase == PHASE_DONE

    def reap(self, w: WorkerProcess) -> Fault:
        """A dead worker, recovered from in place: kill its group, forget it, describe it."""
        # It raised and is on its way out, or it is already dead: either way, don't wait.
        signal_group(w.proc, signal.SIGKILL)
        try:
            w.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass  # stuck in the kernel; the orphan guard still holds its group
        fault = w.fault or self.exit_fault([w])
        fault.wid, fault.slot, fault.in_place = w.wid, w.rank, True
        self.workers.remove(w)
        self.guard.forget(w.pid)
        w.close()
        return fault

    def attempt_failure(self, failed: list[WorkerProcess]) -> Fault | None:
        """Without in-place recovery: the fault that ends the attempt, once its root cause
        had a moment to show (a peer's death reaches survivors' sockets before the kernel lets
        us reap the dead process)."""
        if not failed:
            return None
        if all(exit_cause(w) == ExitCause.PEER_ERROR for w in failed):
            self._peer_errors_since = self._peer_errors_since or time.monotonic()
            if time.monotonic() - self._peer_errors_since < _ROOT_CAUSE_GRACE:
                return None
        return self.exit_fault(failed)

    def exit_fault(self, failed: list[WorkerProcess]) -> Fault:
        """Describe the most likely root cause among workers that exited non-zero together."""
        w = min(failed, key=exit_cause)
        code = w.proc.returncode
        error = w.error()
        if code is None and error:  # reported before the exit: the code it is exiting with
            code = error.get("exit_code")
        kind, detail = describe_exit(code) if code is not None else ("exception", "raised")
        fault = Fault(kind=FaultKind(kind), rank=w.rank, node=self.cfg.node_rank, pid=w.pid,
                      exit_code=code, detail=detail, local_rank=w.local_rank,
                      host=os.uname().nodename)
        fault.error_file = str(w.torchelastic_error_file or w.error_file)
        if error:
            fault.kind = FaultKind.EXCEPTION
            fault.detail = f"{error['type']}: {error['message']}"
            fault.traceback = error["traceback"][-4000:]
            fault.error_class = error.get("error_class")
        beat = w.heartbeat.read()
        if beat is not None:
            fault.step = beat.step
        return fault

    def mirror_target(self, target: SwitchTarget) -> None:
        """Hand the leader's switch request to the workers through their heartbeat pages."""
        for w in self.workers:
            if self._targets_written.get(w.pid) == target:
                continue
            beat = w.heartbeat.read()
            # Not yet in a generation (a replacement, a promoted spare that has not read its
            # slot from this very field): it joins by plan, and gets the request once it is in.
            if beat is not None and beat.generation >= 0:
                w.heartbeat.set_target(target.gen, target.step)
                self._targets_written[w.pid] = target

    # ---------------------------------------------------------------- what the workers say
    def training(self) -> bool:
        """Every worker is stepping (not starting or recovering): spares may warm up now."""
        if self.standby and not self.workers:
            return True  # nothing of the job's runs here
        beats = [w.heartbeat.read() for w in self.workers if w.proc.returncode is None]
        return bool(beats) and all(b is not None and b.phase in STEPPING and b.step >= 0
                                   for b in beats)

    def all_resilient(self) -> bool:
        """Every worker runs the resilient loop (its heartbeat names a generation)."""
        beats = [w.heartbeat.read() for w in self.workers]
        return bool(beats) and all(b is not None and b.generation >= 0 for b in beats)

    def max_step(self) -> int:
        steps = [b.step for w in self.workers
                 if w.proc.returncode is None and (b := w.heartbeat.read()) is not None]
        return max(steps, default=0)

    def all_exited_ok(self) -> bool:
        """Every worker this node runs has exited 0 (vacuously true with none)."""
        return all(w.proc.returncode == 0 for w in self.workers)

    def finished_ranks(self) -> list[int]:
        return sorted(w.rank for w in self.workers if w.proc.returncode == 0)

    def switched_past(self, gen: int) -> bool:
        """Every worker trains in a generation newer than `gen`."""
        beats = [w.heartbeat.read() for w in self.workers]
        return all(b is not None and b.generation > gen and b.phase != PHASE_RECOVERY
                   for b in beats)

    # ---------------------------------------------------------------- stopping
    def stop_all(self) -> None:
        for group in (self.workers, self.spares):
            if group:
                stop_workers(group, self.cfg.kill_grace)
                for w in group:
                    self._unwatch(w)
                    self.guard.forget(w.pid)
                    w.close()
        self.workers, self.spares = [], []

    def close(self) -> None:
        self.stop_all()
        self.tailer.close()
        self.selector.close()
        if self.departures is not None:
            self.departures.close()

def exit_cause(w: WorkerProcess) -> ExitCause:
    """Why a failed worker exited, as far as its exit code and its error record tell."""
    if w.proc.returncode is not None and w.proc.returncode < 0:
        return ExitCause.SIGNALLED
    error = w.error()
    if error is None:
        return ExitCause.OWN_ERROR if w.proc.returncode not in (None, 0) else ExitCause.PEER_ERROR
    if error.get("error_class"):  # the worker classified its own exception (errors.classify)
        return (ExitCause.PEER_ERROR if error["error_class"] == ErrorClass.PEER
                else ExitCause.OWN_ERROR)
    tb = error.get("traceback", "")
    return ExitCause.PEER_ERROR if any(m in tb for m in PEER_ERROR_MARKERS) else ExitCause.OWN_ERROR

