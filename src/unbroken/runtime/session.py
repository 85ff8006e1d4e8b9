"""The worker API: `unbroken.init()` returns a `Run`, whose loop owns the step counter.

    run = unbroken.init(checkpoint_dir="ckpt", checkpoint_every=50)   # async: ~1 ms stall
    model = GPT(cfg); optimizer = torch.optim.AdamW(model.parameters())
    run.track(model, optimizer)                    # the state a step commits
    def build():                                   # once per generation: what needs the group
        return DDP(model)
    def train_step(step, ddp):                     # forward and backward; no optimizer.step()
        x, y = batch(step, run.rank, run.world_size)
        loss = loss_fn(ddp(x), y); loss.backward(); run.log(loss=loss)
    run.train(train_step, steps=1000, build=build) # the runtime steps the optimizer: the commit

Under `unbroken run`, a fault in one worker does not restart the others: survivors leave the
broken generation, re-form the group in place, get the newest committed state from a peer,
call `build()` again and go on (see `runtime/recovery.py`). The simpler `for step in
run.steps(n)` loop is kept for scripts that step the optimizer themselves; a fault then
restarts every worker from the last checkpoint. Both work under `unbroken run`, under
`torchrun`, and in a single plain process.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from unbroken.checkpoint.checkpointer import Checkpointer
from unbroken.control.address import ControlAddress, EtcdCredentials, open_backend
from unbroken.control.channel import Channel
from unbroken.control.messages import LeaveReason
from unbroken.control.retry import RetryingBackend
from unbroken.control.schema import fault_claim, torchrun_restart_prefix
from unbroken.control.signing import Signer
from unbroken.control.worker_env import Role, WorkerEnv
from unbroken.errors import (
    ErrorClass,
    UserError,
    classify,
    current_device,
    first_line,
    is_peer_error,
)
from unbroken.faults.inject import FaultInjector
from unbroken.faults.spec import parse_faults
from unbroken.runtime.config import RunConfig
from unbroken.runtime.heartbeat import (
    PHASE_CHECKPOINT,
    PHASE_DONE,
    PHASE_LONG,
    PHASE_RECOVERY,
    PHASE_STARTING,
    PHASE_TRAINING,
    HeartbeatWriter,
)
from unbroken.runtime.membership import Drained, JobFinished, Membership, RecoveryTimeout
from unbroken.runtime.process_group import (
    AbortableGroups,
    bound_device,
    checkpoint_groups,
    default_backend,
)
from unbroken.runtime.recovery import Generations
from unbroken.runtime.shard_sync import ShardedSync
from unbroken.runtime.shards import LocalShards, fake_world, is_fake_world, is_sharded
from unbroken.runtime.snapshots import PeerSnapshots, auto_every, host_bytes, refusal
from unbroken.runtime.spare import await_promotion
from unbroken.runtime.state_sync import NoStateError, SyncResult, pack
from unbroken.runtime.watchdog import Watchdog
from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import EVENTS_FILE, EventLog


def _process_start_time() -> float | None:
    """Wall-clock time this process was started (Linux), to time imports and set-up."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


# Forming a generation's groups takes milliseconds once every member has arrived; a member
# that dies in that window blocks the others until this bound, then a new plan follows.
_JOIN_TIMEOUT = 3.0


def _torchrun_rendezvous(env: WorkerEnv, timeout: float) -> dict[str, Any]:
    """Under torchrun, rendezvous under a prefix of our own per restart.

    torchrun (torch 2.13) hands every restart the same agent store with no per-restart prefix
    (`TORCHELASTIC_USE_AGENT_STORE`), so a restarted worker can read the dead workers' gloo
    addresses and fail or hang in `init_process_group`. Under `unbroken run` each attempt
    gets a fresh store, and nothing needs doing.
    """
    if not env.agent_store or env.under_agent:
        return {}
    store = dist.TCPStore(env.master_addr, env.master_port, None, False,
                          timedelta(seconds=timeout))
    return {"store": dist.PrefixStore(torchrun_restart_prefix(env.attempt), store),
            "rank": env.rank, "world_size": env.world_size}


class Run:
    """One worker's view of the job; create it with `unbroken.init()`."""

    def __init__(self, config: RunConfig | None = None, **options: Any) -> None:
        """`config`, or the options of `unbroken.init()` (see `RunConfig`)."""
        self.config = config = config or RunConfig(**options)
        backend, timeout, seed = config.backend, config.timeout, config.seed
        self.env = env = WorkerEnv.from_environ()
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        self.attempt = env.attempt
        self.events = EventLog(
            Path(env.run_dir) / EVENTS_FILE if env.run_dir else None, source="worker",
            node=env.node_rank, rank=self.rank, attempt=self.attempt,
        )
        self._heartbeat = HeartbeatWriter(env.heartbeat_file) if env.heartbeat_file else None

        # In place: under `unbroken run` with in-place recovery on, identified by worker id
        # and logical slot (the original rank, which a replacement inherits).
        self.slot = env.slot if env.slot is not None else self.rank
        self.wid = env.worker_id or f"{self.slot}.0"
        # A hot spare: runs the script up to train(), warms up in a sandbox, and waits to be
        # promoted into a failed worker's slot (its rank and slot are unknown until then).
        self.spare = env.role == Role.SPARE
        self.joining = env.joining or self.spare
        self.events.context["slot"] = self.slot
        self.in_place = env.in_place
        self.seed = seed
        self.timeout = timeout
        self.backend = backend or default_backend()
        self.gen = 0
        self._groups = AbortableGroups()

        t0 = time.monotonic()
        self._owns_group = False
        if self.in_place and dist.is_initialized():
            # The script formed the group itself: we cannot abort it from the inside, so a
            # leaving worker could not unblock its peers. Faults restart every worker.
            self.in_place = False
            self.events.emit(Event.IN_PLACE_UNAVAILABLE, reason="process group initialised by the script")
        if self.backend == "nccl":
            if self.spare and self.local_rank >= torch.cuda.device_count():
                raise UserError(
                    f"a hot spare needs a GPU of its own, and this node has "
                    f"{torch.cuda.device_count()} for {env.local_world_size} worker(s) and the "
                    f"spares before this one: run fewer --spares (GPUs - workers per node), "
                    f"or put the spares on a --standby node")
            torch.cuda.set_device(self.local_rank)
        with self._groups.recording():
            if self.world_size > 1 and not dist.is_initialized() and not self.joining:
                dist.init_process_group(backend=self.backend, timeout=timedelta(seconds=timeout),
                                        **_torchrun_rendezvous(env, timeout),
                                        **bound_device(self.backend))
                self._groups.backend = self.backend
                self._owns_group = True
            # Checkpoint collectives get groups of their own, never the training one.
            self._ckpt_groups = (checkpoint_groups(timeout, timeout)
                                 if dist.is_initialized() else None)
        if self.in_place and self.joining and self.world_size > 1 and not dist.is_initialized():
            # A joiner shards its model (if the script does) exactly as its rank will, in a
            # stand-in world that communicates nothing; the real one replaces it at join.
            fake_world(0 if self.spare else self.slot, self.world_size)
        pg_seconds = time.monotonic() - t0
        started = _process_start_time()
        self.events.emit(
            Event.WORKER_START, pid=os.getpid(), world_size=self.world_size,
            startup=round(time.time() - started, 6) if started else None,
            process_group=round(pg_seconds, 6), wid=self.wid, joining=self.joining,
        )

        self._faults = FaultInjector(
            parse_faults(env.faults), self.rank, self._claim_fault, self.events.emit
        )
        groups = self._ckpt_groups
        self._checkpointer = (
            Checkpointer(config.checkpoint_dir, group=groups and groups.writes,
                         control_group=groups and groups.control, keep=config.keep_checkpoints,
                         keep_every=config.keep_every, attempt=self.attempt,
                         record=self.events.emit, clean_stale=not self.joining,
                         persist_timeout=config.checkpoint_timeout, schedule=config.schedule(),
                         fault_point=self._faults.at_point)
            if config.checkpoint_dir else None
        )
        self._step_time: float | None = None  # moving average, for time-based intervals
        self._control: Channel | None = None
        self._claimed_here: set[str] = set()
        self._model: torch.nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._extra: dict[str, Any] = {}
        self._metrics: dict[str, float] = {}
        self.step = 0  # the next step to run; equals the number of committed steps
        # The resilient loop's state (run.train): the user's build(), what it returned for
        # the current generation, the recovery protocol, and whether we hold committed state.
        self._build: Callable[[], Any] | None = None
        self._view: Any = None
        self._generations: Generations | None = None
        self._holds_state = True
        self._watchdog: Watchdog | None = None  # in place: liveness, and abort on notice
        self._progress_hooks: list[Any] = []  # on the current view: forward entered, returned
        self._long_depth = 0  # nested run.phase() blocks
        self._total_steps = 0  # run.train's
        self._rolled_back = 0  # committed steps the last sharded switch gave up
        # Sharded state, in place: its local shards, their in-memory snapshots, the switch.
        self._shards: LocalShards | None = None
        self._sharded_sync: ShardedSync | None = None  # and its snapshots, if any

    # ------------------------------------------------------------------ faults
    def _channel(self) -> Channel:
        """The control channel (under `unbroken run`), connected once, lazily."""
        if self._control is None:
            env = self.env
            signer = Signer(bytes.fromhex(env.secret)) if env.secret else None
            address = ControlAddress.parse(env.control, EtcdCredentials.from_environ(os.environ))
            backend = RetryingBackend(lambda: open_backend(address, env.run_id, 30.0),
                                      window=env.retry_window, on_lost=self._control_lost,
                                      on_back=self._control_back)
            self._control = Channel(backend, signer, on_forged=self._forged)
        return self._control

    def _control_lost(self, error: str) -> None:
        self.events.emit(Event.CONTROL_PLANE_LOST, error=error)

    def _control_back(self, outage: float) -> None:
        self.events.emit(Event.CONTROL_PLANE_BACK, outage=round(outage, 3))

    def _forged(self, key: str, why: str) -> None:
        self.events.emit(Event.FORGED_MESSAGE, key=key, reason=why)

    def _claim_fault(self, key: str) -> bool:
        """A fault fires once per job: claimed in the control store, or per process without one."""
        if self.env.under_agent:
            return self._channel().claim(fault_claim(key)) == 1
        if key in self._claimed_here:
            return False
        self._claimed_here.add(key)
        return True

    # ------------------------------------------------------------------ state
    def track(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer, **extra: Any) -> None:
        """Register what a checkpoint holds: the model (DDP/FSDP-wrapped or not), its
        optimizers, and any other objects with `state_dict`/`load_state_dict`."""
        for name, obj in extra.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise UserError(f"track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict")
        self._model, self._optimizers, self._extra = model, list(optimizers), extra
        if self._checkpointer is not None:
            self._checkpointer.protect(model, self._optimizers)

    def state_dict(self) -> dict[str, Any]:
        if self._model is None:
            raise UserError("call run.track(model, optimizer) before checkpointing or run.steps()")
        model_sd, optim_sd = get_state_dict(self._model, self._optimizers)
        state: dict[str, Any] = {
            "model": model_sd,
            "unbroken": {"step": torch.tensor(self.step), "rng_cpu": torch.get_rng_state()},
        }
        if self._optimizers:
            state["optim"] = optim_sd
        for name, obj in self._extra.items():
            state[f"extra_{name}"] = obj.state_dict()
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        set_state_dict(self._model, self._optimizers, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))
        for name, obj in self._extra.items():
            obj.load_state_dict(state[f"extra_{name}"])
        if "rng_cpu" in state["unbroken"]:  # a checkpoint's; state from a peer has none
            torch.set_rng_state(state["unbroken"]["rng_cpu"])
        self.step = int(state["unbroken"]["step"])
        self._holds_state = True

    def save_checkpoint(self) -> bool:
        """Start a checkpoint of the committed state now (collective: every rank calls it).

        It is snapshotted while the next step runs and persisted in the background. False if
        it was deferred because the previous save is still being written."""
        if self._checkpointer is None:
            raise UserError("no checkpoint_dir was given to unbroken.init()")
        return self._checkpointer.start(self.state_dict(), self.step, self._step_time)

    def _after_step(self, duration: float) -> None:
        """Per committed step: the step-time average, and a checkpoint if one is due."""
        avg = self._step_time
        self._step_time = duration if avg is None else 0.9 * avg + 0.1 * duration
        if self._checkpointer is not None and self._checkpointer.due(self.step):
            self.save_checkpoint()
        self._snapshot()

    def _finish_checkpoints(self) -> None:
        """The final state, committed before we report done (bounded by checkpoint_timeout)."""
        if self._checkpointer is None:
            return
        self._stamp(self.step, PHASE_CHECKPOINT)
        self._checkpointer.finish(self.state_dict(), self.step)

    def _resume(self) -> None:
        if self._checkpointer is None:
            return
        self._stamp(self.step, PHASE_CHECKPOINT)
        built: list[dict[str, Any]] = []  # the state, built only if there is one to load

        def build() -> dict[str, Any]:
            built.append(self.state_dict())
            return built[0]

        if self._checkpointer.load_latest(build) is not None:
            self._restore(built[0])
        self._stamp(self.step, PHASE_TRAINING)

    # ------------------------------------------------------------------ the loop
    def _stamp(self, step: int, phase: int) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stamp(step, phase)

    def log(self, **metrics: Any) -> None:
        """Attach metrics (floats or one-element tensors) to the current step's event."""
        for name, value in metrics.items():
            self._metrics[name] = float(value.item() if isinstance(value, torch.Tensor) else value)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Declare a part of a step long (an evaluation, a recompile, a large checkpoint of
        the script's own): inside it no hang timeout runs, and a rank that others wait for
        meanwhile is not blamed for their wait. Its time is not counted as step time.

            def train_step(step, model):
                if step % 100 == 0:
                    with run.phase("eval"):
                        evaluate(model)
                ...

        Use it only around work that may legitimately take many step times: a hang inside
        it is not detected (a stopped process still is). Blocks may nest."""
        t0 = time.monotonic()
        self._long_depth += 1
        outer = self._heartbeat.phase if self._heartbeat is not None else PHASE_TRAINING
        if self._long_depth == 1:
            self._stamp(self.step, PHASE_LONG)
        try:
            yield
        finally:
            self._long_depth -= 1
            if self._long_depth == 0:
                self._stamp(self.step, outer)  # a step's clock starts again here
                self.events.emit(Event.PHASE, name=name, step=self.step,
                                 duration=round(time.monotonic() - t0, 6))

    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps still to run, from the last committed one up to `total`."""
        if total < 0:
            raise UserError(f"steps(total): total must be >= 0, got {total}")
        if self._checkpointer is not None and self._model is None:
            raise UserError("call run.track(model, optimizer) before run.steps() to checkpoint")
        self._resume()
        self.events.emit(Event.RESUME, step=self.step, total=total)
        while self.step < total:
            step = self.step
            self._stamp(step, PHASE_TRAINING)
            self._faults.at_step(step)
            self._metrics = {}
            t0 = time.perf_counter()
            yield step
            duration = time.perf_counter() - t0
            self.step = step + 1  # the body returned: the step is committed
            self.events.emit(Event.STEP, step=step, duration=round(duration, 6), **self._metrics)
            self._after_step(duration)
        self._finish_checkpoints()
        self._stamp(self.step, PHASE_DONE)
        self.events.emit(Event.TRAINING_DONE, step=self.step)

    # ------------------------------------------------------------------ the resilient loop
    def train(
        self,
        step_fn: Callable[[int, Any], Any],
        steps: int,
        build: Callable[[], Any] | None = None,
    ) -> None:
        """Run steps up to `steps`, recovering in place from faults of other workers.

        `step_fn(step, model)` runs one step's forward and backward. `model` is what `build()`
        returned for the current generation (the tracked model if there is no `build`). The
        runtime then steps the tracked optimizers and schedulers: that update is the commit.
        """
        if steps < 0:
            raise UserError(f"train(steps=...): must be >= 0, got {steps}")
        if self._model is None:
            raise UserError("call run.track(model, optimizer) before run.train()")
        self._build = build
        self._total_steps = steps
        self._holds_state = not self.joining
        if self.in_place:
            self._generations = Generations(
                Membership(self._channel(), self.attempt, self.wid, self._recovery_beat,
                           timeout=self.env.recovery_timeout),
                self._groups, self.backend, self.timeout, join_timeout=_JOIN_TIMEOUT,
                record=self.events.emit, fault_point=self._faults.at_point)
        if self.in_place and is_sharded(self._model):
            self._setup_sharded()
        if self.spare:
            self._warm_up(step_fn)
            self._await_promotion()
            self._join(reason="spare")
        elif self.joining:
            self._join(reason="replacement")
        else:
            self._resume()
            self._view = self._build_view()
            self._check_in_place()
        self.events.emit(Event.RESUME, step=self.step, total=steps, gen=self.gen)
        if self._heartbeat is not None and self.in_place:
            self._heartbeat.set_generation(self.gen)
            self._watchdog = Watchdog(self._heartbeat, self._groups.interrupt,
                                      self._aborted_on_notice)
            self._watchdog.start()
        while self.step < steps:
            step = self.step
            if self._heartbeat is not None:
                self._stamp(step, PHASE_TRAINING)
                if self.in_place and self._switch_due(step):
                    self._leave_and_join(LeaveReason.SWITCH)
                    continue
            self._metrics = {}
            t0 = time.perf_counter()
            self._entered(step)
            try:
                self._faults.at_step(step)
                if self.seed is not None:
                    self._seed_step(step)
                step_fn(step, self._view)
            except Exception as exc:
                self._left()
                if not self.in_place:
                    raise
                self._step_failed(step, exc)
                continue
            self._commit()
            duration = time.perf_counter() - t0
            self.step = step + 1
            self.events.emit(Event.STEP, step=step, duration=round(duration, 6), gen=self.gen,
                             **self._metrics)
            try:
                try:
                    self._after_step(duration)
                    if self.step == steps:
                        self._finish_checkpoints()
                finally:
                    self._left()
            except Exception as exc:
                if not (self.in_place and is_peer_error(exc)):
                    raise
                self._leave_and_join(LeaveReason.PEER, error=first_line(exc))
        if self.in_place:  # first: a done heartbeat means the leader counts this member done
            self._generations.membership.report_done(self.gen)
        self._stamp(self.step, PHASE_DONE)
        self.events.emit(Event.TRAINING_DONE, step=self.step, gen=self.gen, pid=os.getpid())

    def _check_in_place(self) -> None:
        """Before the first step, not at the first fault: state that cannot travel between
        peers (sharded: DTensors) cannot be recovered in place, so faults restart every
        worker from the checkpoint at once, with no switch tried first. Said in one line."""
        if not self.in_place:
            return
        if self._sharded_sync is not None:
            # Generation 0's mesh on groups a leave can abort (the script's may not be).
            self._sharded_sync.form(self.rank, self.world_size)
            return
        try:
            pack(self._peer_state())
        except TypeError as exc:
            self._in_place_unavailable(str(exc))

    def _in_place_unavailable(self, why: str) -> None:
        why = f"{why}: a fault restarts every worker from the last checkpoint"
        self.events.emit(Event.IN_PLACE_UNAVAILABLE, reason=why)
        if self.rank == 0:
            print(f"unbroken: in-place recovery is not available: {why}", file=sys.stderr,
                  flush=True)
        self.in_place = False

    def _setup_sharded(self) -> None:
        """Sharded state (FSDP2, HSDP) recovers in place from peers: replicas, and in-memory
        snapshots replicated to buddies (`runtime/snapshots.py`). What cannot is named in one
        line now, not at the first fault; snapshots that would not fit in host memory are
        refused with the figures, and faults then need a live replica or the checkpoint."""
        try:
            shards = LocalShards(self._model, self._optimizers, self._extra)
        except TypeError as exc:
            return self._in_place_unavailable(str(exc))
        why = shards.unsupported(self.world_size)
        if why is not None:
            return self._in_place_unavailable(why)
        config, env = self.config, self.env
        if self.joining:
            shards.prime()  # its optimizer state exists, so its tensor list matches a holder's
        snapshots = None
        if config.snapshot_every != 0:
            snapshots = PeerSnapshots(shards, config.snapshot_replicas, config.snapshot_every,
                                      self.events.emit)
        self._shards = shards
        self._sharded_sync = ShardedSync(shards, snapshots, self._groups, env.local_world_size,
                                         self.timeout, self.events.emit)
        self._generations.sharded = True

    def _snapshot(self) -> None:
        """After a committed step: start an in-memory snapshot if one is due. Before the
        first, the ranks agree that it fits in host memory (the optimizer state exists by
        then); with `snapshot_every=None` the first is timed, and the ranks then agree on
        the interval. Every decision is the same on every rank, so rounds pair up."""
        sync = self._sharded_sync
        snaps = sync.snapshots if sync is not None else None
        if snaps is None or self.step >= self._total_steps:
            return  # the last step: the run ends, and no fault can need this snapshot
        if not snaps.started:
            if self.step % 5 == 0:  # past the first, slow steps; the same on every rank
                if self._snapshots_fit(snaps):
                    snaps.take(self.step)
            return
        if snaps.every is None:
            if snaps.rounds < 2:
                snaps.take(self.step)  # a second round, timed with its buffers warm
                return
            snaps.wait()
            proposal = torch.tensor([auto_every(snaps.round_seconds or 0.0,
                                                self._step_time or 0.0)])
            dist.all_reduce(proposal, op=dist.ReduceOp.MAX, group=snaps.group)
            snaps.every = int(proposal.item())
            host = host_bytes(self._shards.nbytes(), snaps.replicas)
            self.events.emit(Event.SNAPSHOT_CONFIG, every=snaps.every, auto=True,
                             replicas=snaps.replicas, shard_bytes=self._shards.nbytes(),
                             host_bytes=host, round_s=round(snaps.round_seconds or 0.0, 6),
                             step_s=round(self._step_time or 0.0, 6))
            if self.rank == 0:
                print(f"unbroken: an in-memory snapshot every {snaps.every} step(s): a round "
                      f"takes {snaps.round_seconds or 0:.3f} s and a step "
                      f"{self._step_time or 0:.3f} s, so at most 1 % of step time; "
                      f"{host / 2**20:.0f} MiB of host memory per rank", file=sys.stderr,
                      flush=True)
        elif snaps.due(self.step):
            snaps.take(self.step)

    def _snapshots_fit(self, snaps: PeerSnapshots) -> bool:
        """Agree (collective) that snapshots fit in every rank's host memory; if one rank's
        do not, none takes any, and each says why with the figures."""
        available = _available_memory() // max(1, self.env.local_world_size)
        why = refusal(self._shards.nbytes(), snaps.replicas, available)
        fits = torch.tensor([0 if why else 1])
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=snaps.group)
        if fits.item():
            if snaps.every is not None:
                self.events.emit(Event.SNAPSHOT_CONFIG, every=snaps.every, auto=False,
                                 replicas=snaps.replicas, shard_bytes=self._shards.nbytes(),
                                 host_bytes=host_bytes(self._shards.nbytes(), snaps.replicas))
            return True
        why = why or "another rank's in-memory snapshots would not fit in its host memory"
        self.events.emit(Event.SNAPSHOTS_REFUSED, reason=why,
                         need_bytes=host_bytes(self._shards.nbytes(), snaps.replicas),
                         available_bytes=available)
        if self.rank == 0:
            print(f"unbroken: {why}", file=sys.stderr, flush=True)
        self._sharded_sync.snapshots = None
        return False

    def _warm_up(self, step_fn: Callable[[int, Any], Any]) -> None:
        """A spare's shadow iterations: the real step on a private one-process group (real
        kernels, allocator and caches; nothing reaches the job), then discarded. The state
        is replaced by a peer's when the spare is promoted."""
        t0 = time.monotonic()
        steps = self.env.shadow_steps
        sharded = self._shards is not None
        if sharded:
            # Warm up as rank 0 of the stand-in world of the real size, so that only
            # shard-sized state is ever allocated. Any slot can take these shapes only if
            # every sharded dimension divides evenly.
            uneven = self._shards.rank_independent()
            if uneven is not None:
                raise UserError(f"a hot spare cannot serve this sharded model: {uneven} does "
                                "not divide evenly, so each rank's shard has its own shape; "
                                "make the sharded dimensions divisible by the world size, "
                                "or run without --spares (replacements start per slot)")
            self.rank = 0
            self._shadow_steps(step_fn, steps)
        else:
            if is_fake_world():
                dist.destroy_process_group()
            self.rank, self.world_size = 0, 1
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            try:
                self._shadow_steps(step_fn, steps)
            finally:
                dist.destroy_process_group()
        self._holds_state = False
        detail = {}
        if sharded:
            detail = {"sharded": True, "shard_bytes": self._shards.nbytes(),
                      "largest_tensor_bytes": max((t.numel() * t.element_size()
                                                   for t in self._shards.tensors()), default=0)}
        self.events.emit(Event.SPARE_READY, wid=self.wid, shadow_steps=steps,
                         duration=round(time.monotonic() - t0, 6), **detail)

    def _shadow_steps(self, step_fn: Callable[[int, Any], Any], steps: int) -> None:
        """The real step, `steps` times, on whatever group is formed; then discarded."""
        view = self._model if self._build is None else self._build()
        for step in range(steps):
            self._stamp(step, PHASE_STARTING)
            if self.seed is not None:
                self._seed_step(step)
            step_fn(step, view)
            self._commit()

    def _await_promotion(self) -> None:
        """Wait until the agent assigns us a slot, or exit 0 if the job ends first."""
        if self._heartbeat is None:
            raise UserError("a spare needs its agent: run the script under `unbroken run --spares N`")
        slot = await_promotion(self._heartbeat, self._generations.membership.finished)
        if slot is None:
            self.events.emit(Event.JOINER_UNUSED, wid=self.wid)
            self.close()
            sys.exit(0)
        self.slot = self.rank = slot
        self.events.context["slot"] = self.slot
        self.events.context["rank"] = self.slot
        self.events.emit(Event.SPARE_PROMOTED, wid=self.wid, slot=self.slot)

    def _seed_step(self, step: int) -> None:
        """Seed the RNGs from (seed, step, slot). Not torch.manual_seed: it costs ~80 us."""
        seed = (self.seed * 1_000_003 + step) * 10_007 + self.slot
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed(seed)

    def _build_view(self) -> Any:
        if not dist.is_initialized():
            view = self._model
        else:
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # build() reads them
            view = self._model if self._build is None else self._build()
        self._watch_progress(view)
        return view

    def _commit(self) -> None:
        """The optimizer update: after it, this rank holds the state of the step."""
        self._holds_state = False  # torn if the update itself raises
        for optimizer in self._optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for obj in self._extra.values():
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                obj.step()
        self._holds_state = True

    def _switch_due(self, step: int) -> bool:
        gen, at_step = self._heartbeat.target()
        return gen > self.gen and step >= at_step

    def _recovery_beat(self) -> None:
        self._stamp(self.step, PHASE_RECOVERY)

    def _entered(self, step: int) -> None:
        """Inside a step of this generation: the watchdog may abort it on notice."""
        if self._watchdog is not None:
            self._watchdog.entered(self.gen, step)

    def _left(self) -> None:
        if self._watchdog is not None:
            self._watchdog.left()

    def _aborted_on_notice(self, gen: int, target_gen: int, step: int) -> None:
        """The watchdog thread aborted generation `gen`: the leader had broken it."""
        self.events.emit(Event.ABORT_ON_NOTICE, gen=gen, target_gen=target_gen, step=step)

    def _advance(self, *_: Any) -> None:
        """A point inside the step passed (a forward hook): see `runtime.heartbeat`."""
        if self._heartbeat is not None:
            self._heartbeat.advance()

    def _watch_progress(self, view: Any) -> None:
        """Mark the model's forward, entered and returned, on the heartbeat page, so that a
        rank stuck before it (data loading, a kernel) is seen behind the ranks already in the
        gradient collective. On the current view only: the last view's hooks go with it."""
        for handle in self._progress_hooks:
            handle.remove()
        self._progress_hooks = []
        if self._heartbeat is not None and isinstance(view, torch.nn.Module):
            self._progress_hooks = [view.register_forward_pre_hook(self._advance),
                                    view.register_forward_hook(self._advance)]

    def _step_failed(self, step: int, exc: Exception) -> None:
        for optimizer in self._optimizers:
            optimizer.zero_grad(set_to_none=True)
        self._model.zero_grad(set_to_none=True)
        kind = classify(exc, current_device())
        if kind == ErrorClass.PEER:
            self._leave_and_join(LeaveReason.PEER, error=first_line(exc))
            return
        error = f"{type(exc).__name__}: {exc}"
        tb = "".join(traceback.format_exception(exc))[-4000:]
        self.events.emit(Event.STEP_FAILED, step=step, gen=self.gen, error=error, traceback=tb,
                         error_class=kind.value)
        if kind == ErrorClass.OWN_DEVICE:
            # Its CUDA context is broken for good: this process dies (its agent reports the
            # death) and a fresh one takes the rank, while the survivors go on in place.
            raise exc
        self._leave_and_join(LeaveReason.EXCEPTION, error=error, traceback=tb)

    def _leave_and_join(self, reason: LeaveReason, **detail: Any) -> None:
        t0 = time.monotonic()
        self._stamp(self.step, PHASE_RECOVERY)
        self._view = None
        self._generations.leave(self.step, self._holds_state, reason, **detail)
        self.events.emit(Event.GEN_LEAVE, gen=self.gen, step=self.step, reason=reason.value,
                         holds_state=self._holds_state, duration=round(time.monotonic() - t0, 6))
        self._join(reason.value)

    def _join(self, reason: str) -> None:
        """Wait for the next generation naming us; switch to it with the newest state."""
        t0 = time.monotonic()
        self._stamp(self.step, PHASE_RECOVERY)
        gens = self._generations
        if self.joining:
            self._channel()  # connect before we announce ourselves
            gens.membership.register_joiner(self.slot)
        if is_fake_world():
            dist.destroy_process_group()  # the stand-in world; the plan's replaces it
        if self._sharded_sync is not None:
            sync = self._sync_shards
        else:
            sync = gens.replicated(self._peer_state, self._restore)
        try:
            switch = gens.join(lambda: (self.step, self._holds_state), sync,
                               self._build_view, joining=self.joining,
                               formed=self._checkpoints_formed)
        except JobFinished:
            self.events.emit(Event.JOINER_UNUSED, slot=self.slot)
            self.close()
            sys.exit(0)  # the job ended before this replacement was needed
        except Drained:
            self.events.emit(Event.DRAINED, slot=self.slot, step=self.step, pid=os.getpid())
            self.close()
            sys.exit(0)  # a spare took over this rank, with the state it left with
        except NoStateError:
            # We left saying why (`switch_failed`); the leader now restarts every worker from
            # the checkpoint, and stops us. Exiting first would read as a fault of our own.
            try:
                gens.membership.await_finished()
            except RecoveryTimeout:
                pass
            raise
        self.joining = False
        self._holds_state = True
        self.step = switch.sync.step
        lost, self._rolled_back = self._rolled_back, 0
        self.gen, self.rank, self.world_size = switch.plan.gen, switch.plan.rank, switch.plan.world_size
        self._ckpt_groups = switch.ckpt_groups
        self._view = switch.view
        self._owns_group = True  # formed by the runtime: close() tears it down
        gens.report_up(switch)
        self.events.context["rank"] = self.rank
        self._stamp(self.step, PHASE_TRAINING)
        if self._heartbeat is not None:
            self._heartbeat.set_generation(self.gen)
        self.events.emit(Event.GEN_SWITCH, gen=self.gen, reason=reason, step=self.step,
                         world_size=self.world_size, state_from=switch.sync.source,
                         received_bytes=switch.sync.received_bytes, tries=switch.tries,
                         rolled_back=lost,
                         duration=round(time.monotonic() - t0, 6),
                         **switch.phases)

    def _sync_shards(self, plan: Any, committed_step: int, holds_state: bool) -> SyncResult:
        """The state step of a sharded switch (`ShardedSync`): this rank's shard at the step
        every shard is held at, from itself, a replica or a buddy's snapshot."""
        self.rank, self.world_size = plan.rank, plan.world_size
        result = self._sharded_sync.sync(plan.rank, plan.world_size, committed_step,
                                         holds_state, torn=self._torn)
        # Before `formed` (the checkpoint schedule) and `build`: every member now stands at
        # the resumed step, holding its state.
        self._rolled_back = max(0, committed_step - result.step) if holds_state else 0
        self.step, self._holds_state = result.step, True
        shard_plan = self._sharded_sync.plan
        self.events.emit(Event.SHARD_SYNC, gen=plan.gen, step=result.step,
                         committed=committed_step if holds_state else None,
                         restored=plan.rank in shard_plan.restore,
                         source=result.source, received_bytes=result.received_bytes,
                         transfers=[[t.src, t.dst, t.live] for t in shard_plan.transfers])
        return result

    def _torn(self) -> None:
        self._holds_state = False  # being overwritten: no committed state until it is whole

    def _checkpoints_formed(self, plan: Any, groups: Any) -> None:
        """In a new generation: checkpoint over its groups, on a schedule its members agree."""
        if self._checkpointer is not None:
            self._checkpointer.use_groups(groups and groups.writes, groups and groups.control,
                                          plan.gen)
            self._checkpointer.rejoin(self.step)

    def _peer_state(self) -> dict[str, Any]:
        state = self.state_dict()
        del state["unbroken"]["rng_cpu"]  # per-rank, and re-seeded from the step anyway
        return state

    def close(self) -> None:
        """Tear down what `init` created; safe to call twice."""
        snaps = self._sharded_sync.snapshots if self._sharded_sync is not None else None
        if snaps is not None and not snaps.wait(timeout=30.0):
            # A daemon thread: it dies with the process. Said, not waited for.
            print("unbroken: an in-memory snapshot round was still running at close",
                  file=sys.stderr)
        if self._watchdog is not None:
            self._watchdog.stop()
            for error in self._watchdog.errors:
                print(f"unbroken: the watchdog thread failed: {error}", file=sys.stderr)
            self._watchdog = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
        self.events.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _available_memory() -> int:
    """Host memory the kernel can give without swapping (MemAvailable), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def init(
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
    backend: str | None = None,
    timeout: float = 1800.0,
    seed: int | None = 0,
    *,
    checkpoint_every_seconds: float | None = None,
    checkpoint_mtbf_hours: float | None = None,
    keep_every: int | None = None,
    checkpoint_timeout: float = 600.0,
    snapshot_every: int | None = None,
    snapshot_replicas: int = 1,
) -> Run:
    """Join the job: initialise the process group (gloo on CPU, NCCL on GPU) unless the
    script already did, and set up heartbeat, events, faults and checkpoints.

    Checkpoints (async: snapshot while the next step runs, persist in the background) are
    taken every `checkpoint_every` steps, or every `checkpoint_every_seconds`, or at the
    Young/Daly interval for the measured checkpoint cost and an expected mean time between
    failures of `checkpoint_mtbf_hours`; and at the end. The newest `keep_checkpoints` are
    kept, and every one whose step is a multiple of `keep_every`. A save not committed within
    `checkpoint_timeout` seconds is reported and skipped over; the loop never waits for it.

    Sharded state (FSDP2, HSDP) under `unbroken run` recovers in place: from a live replica
    (HSDP), or from in-memory snapshots of every rank's shards taken every `snapshot_every`
    steps (None: at most 1 % of step time; 0: none) and copied to `snapshot_replicas` buddies
    (on other nodes, where there are several).

    `seed`: `train()` seeds torch's RNG from (seed, step, slot) before each step, so a step
    redone or run by a replacement draws the same numbers; None leaves the RNG alone.
    """
    return Run(RunConfig(checkpoint_dir, checkpoint_every, keep_checkpoints, backend, timeout, seed,
                         checkpoint_every_seconds=checkpoint_every_seconds,
                         checkpoint_mtbf_hours=checkpoint_mtbf_hours, keep_every=keep_every,
                         checkpoint_timeout=checkpoint_timeout, snapshot_every=snapshot_every,
                         snapshot_replicas=snapshot_replicas))
