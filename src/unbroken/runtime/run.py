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
call `build()` again and go on. `Run` is the user's surface; the recovery itself is the
engine's (`runtime/engine.py`, contract in docs/engine.md), which other loops can drive too.
A loop of the user's own keeps its shape (`for step, batch in run.steps(n, data=loader)`
with its step in `with run.try_step():`, docs/your-loop.md) and recovers in place too; the
plain `for step in run.steps(n)` restarts every worker from the last checkpoint on a fault.
Both work under `unbroken run`, under `torchrun`, and in a single plain process.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from unbroken.control import departure_post
from unbroken.control.worker_env import Role, WorkerEnv, node_dir
from unbroken.errors import UserError
from unbroken.faults.inject import FaultInjector
from unbroken.faults.spec import parse_faults
from unbroken.runtime.config import AnomalyConfig, EngineSettings, RunConfig
from unbroken.runtime.control_link import ControlLink
from unbroken.runtime.engine import Engine, Verdict
from unbroken.runtime.generations.membership import Membership
from unbroken.runtime.generations.recovery import Generations
from unbroken.runtime.groups.first_group import form_first_group
from unbroken.runtime.groups.process_group import default_backend, this_process
from unbroken.runtime.heartbeat import PHASE_LONG, PHASE_RECOVERY, PHASE_TRAINING, HeartbeatWriter
from unbroken.runtime.host import available_memory, process_start_time
from unbroken.runtime.own_loop.loader_state import MarkStore
from unbroken.runtime.own_loop.loop import OwnLoop
from unbroken.runtime.own_loop.step_block import StepBlock
from unbroken.runtime.position import Position
from unbroken.runtime.tracked import TrackedState
from unbroken.runtime.watch import watcher
from unbroken.telemetry import schema as ev
from unbroken.telemetry.events import EVENTS_FILE, EventLog

# Forming a generation's groups takes milliseconds once every member has arrived; a member
# that dies in that window blocks the others until this bound, then a new plan follows.
_JOIN_TIMEOUT = 3.0


class Run:
    """One worker's view of the job; create it with `unbroken.init()`."""

    def __init__(self, config: RunConfig | None = None, **options: Any) -> None:
        """`config`, or the options of `unbroken.init()` (see `RunConfig`)."""
        watcher.mute_steps()  # this script reports its own steps: the hooks' would double them
        self.config = config = config or RunConfig(**options)
        self.env = env = WorkerEnv.from_environ()
        self.local_rank, self.attempt = env.local_rank, env.attempt
        self.backend = config.backend or default_backend()
        self.seed, self.timeout = config.seed, config.timeout
        slot = env.slot if env.slot is not None else env.rank
        spare = env.role == Role.SPARE
        self.events = events = watcher.shared_log() or EventLog(
            Path(env.run_dir) / EVENTS_FILE if env.run_dir else None, source="worker",
            node=env.node_rank, rank=env.rank, attempt=env.attempt)
        events.context["slot"] = slot
        heartbeat = HeartbeatWriter(env.heartbeat_file) if env.heartbeat_file else None
        groups = this_process()
        first = form_first_group(env, self.backend, config.timeout, groups,
                                 joining=env.joining or spare, spare=spare,
                                 in_place=env.in_place)
        # Later generations are formed with generation 0's backend string, the script's
        # own included ("cpu:gloo,cuda:nccl": its CPU collectives keep a backend).
        self.backend = groups.backend or self.backend
        if env.in_place and first.formed_by_script:
            # The script formed the group itself: we cannot abort it from the inside, so a
            # leaving worker could not unblock its peers. Faults restart every worker.
            events.emit(ev.InPlaceUnavailable(reason="process group initialised by the script"))
        settings = EngineSettings(
            in_place=env.in_place and not first.formed_by_script, slot=slot,
            wid=env.worker_id or f"{slot}.0", spare=spare, joining=env.joining or spare,
            seed=config.seed, shadow_steps=env.shadow_steps,
            snapshot_every=config.snapshot_every, snapshot_replicas=config.snapshot_replicas,
            local_world=env.local_world_size, timeout=config.timeout, node=env.node_rank,
            node_dir=str(node_dir(env.run_dir, env.node_rank)) if env.run_dir else None,
            anomalies=config.anomalies)
        started = process_start_time()
        events.emit(ev.WorkerStart(pid=os.getpid(), world_size=env.world_size,
                    startup=round(time.time() - started, 6) if started else None,
                    process_group=round(first.seconds, 6), wid=settings.wid,
                    joining=settings.joining))
        self._link = link = ControlLink(env, events.emit)
        self._under_agent = env.under_agent
        faults = FaultInjector(parse_faults(env.faults), env.rank, link.claim_fault, events.emit)
        ckpt = first.ckpt_groups
        checkpointer = None
        if config.checkpoint_dir:  # DCP (and DTensor) are imported only for a job that saves
            from unbroken.checkpoint.checkpointer import Checkpointer

            checkpointer = Checkpointer(
                config.checkpoint_dir, group=ckpt and ckpt.writes,
                control_group=ckpt and ckpt.control, keep=config.keep_checkpoints,
                keep_every=config.keep_every, attempt=env.attempt, record=events.emit,
                clean_stale=not settings.joining, persist_timeout=config.checkpoint_timeout,
                schedule=config.schedule(), fault_point=faults.at_point)
        generations = None
        if settings.in_place:
            membership = Membership(link.channel(), env.attempt, settings.wid,
                                    lambda: engine.stamp(engine.position.step, PHASE_RECOVERY),
                                    timeout=env.recovery_timeout, node=env.node_rank,
                                    post=partial(departure_post.post, env.departures_socket)
                                    if env.departures_socket else None)
            generations = Generations(membership, groups, self.backend, config.timeout,
                                      join_timeout=_JOIN_TIMEOUT, record=events.emit,
                                      fault_point=faults.at_point)
        self._engine = engine = Engine(
            Position(env.rank, env.world_size, 0), settings, events=events, faults=faults,
            groups=groups, heartbeat=heartbeat, checkpointer=checkpointer,
            generations=generations, available_memory=available_memory,
            file_drain=link.file_drain if env.under_agent else None)
        engine.owns_group = first.owned
        self._metrics: dict[str, float] = {}
        self._long_depth = 0  # nested run.phase() blocks
        self._loop: OwnLoop | None = None  # `run.steps(total, data=...)`
        # What exists now (the imports, the runtime) is never garbage: a switch's collection
        # (`generations/release.py`) then walks only what the script makes from here on.
        gc.freeze()

    # ------------------------------------------------------------------ where we stand
    @property
    def rank(self) -> int:
        """This worker's rank in the current generation."""
        return self._engine.position.rank

    @property
    def world_size(self) -> int:
        return self._engine.position.world_size

    @property
    def step(self) -> int:
        """The next step to run; equals the number of committed steps."""
        return self._engine.position.step

    @property
    def gen(self) -> int:
        """The generation: 0 as launched, one more per switch in place."""
        return self._engine.position.gen

    @property
    def slot(self) -> int:
        """The logical slot (the original rank, which a replacement inherits)."""
        return self._engine.slot

    @property
    def wid(self) -> str:
        return self._engine.settings.wid

    @property
    def spare(self) -> bool:
        """A hot spare (until the run ends, even once promoted)."""
        return self._engine.settings.spare

    @property
    def joining(self) -> bool:
        """A spare or replacement that has not yet joined a generation."""
        return self._engine.joining

    @property
    def in_place(self) -> bool:
        """Faults are recovered in place (else every worker restarts)."""
        return self._engine.in_place

    @property
    def engine(self) -> Engine:
        """The recovery engine, for loops other than `train` (docs/engine.md)."""
        return self._engine

    # ------------------------------------------------------------------ state
    def track(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer, **extra: Any) -> None:
        """Register what a checkpoint holds: the model (DDP/FSDP-wrapped or not), its
        optimizers, and any other objects with `state_dict`/`load_state_dict`."""
        self._engine.track(TrackedState(model, list(optimizers), extra))

    def state_dict(self) -> dict[str, Any]:
        """The committed state, as a checkpoint holds it."""
        return self._engine.need_tracked("checkpointing").state_dict(self.step)

    def save_checkpoint(self) -> bool:
        """Start a checkpoint of the committed state now (collective: every rank calls it).

        It is staged (copied to host memory) while the next step runs and persisted in the
        background. False if it was deferred because the previous save is still being
        written."""
        engine = self._engine
        return engine.checkpoints.save(engine.need_tracked("checkpointing"), self.step,
                                       engine.step_time)

    def skip_steps(self, steps: set[int] | list[int]) -> None:
        """Pass over these steps in `train`: no forward, no update, the learning-rate
        schedule not advanced; their batches are never trained on. Call it before `train`,
        with the same steps on every rank (a reference run for a job that skipped them)."""
        self._engine.anomalies.asked.update(int(s) for s in steps)

    # ------------------------------------------------------------------ the loops
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
        heartbeat = self._engine.heartbeat
        self._long_depth += 1
        outer = heartbeat.phase if heartbeat is not None else PHASE_TRAINING
        if self._long_depth == 1:
            self._engine.stamp(self.step, PHASE_LONG)
        try:
            yield
        finally:
            self._long_depth -= 1
            if self._long_depth == 0:
                self._engine.stamp(self.step, outer)  # a step's clock starts again here
                self.events.emit(ev.Phase(name=name, step=self.step,
                                 duration=round(time.monotonic() - t0, 6)))

    def steps(self, total: int, data: Any = None,
              micro_batches: int | None = None) -> Iterator[Any]:
        """Yield the steps still to run, from the last committed one up to `total`; the body
        steps the optimizer itself.

        Without `data`: yields each step; a fault restarts every worker. With `data` (a
        DataLoader): yields `(step, batch)`, or `(step, [k micro-batches])` with
        `micro_batches=k`, and a fault of a peer inside a `with run.try_step():` block is
        recovered in place: the same step comes again with the same batch
        (docs/your-loop.md)::

            for step, batch in run.steps(1000, data=loader):
                with run.try_step():
                    loss = model(batch).loss; loss.backward()
                    optimizer.step(); optimizer.zero_grad()
        """
        if total < 0:
            raise UserError(f"steps(total): total must be >= 0, got {total}")
        if data is not None:
            marks = None
            if self._engine.in_place and self._under_agent:
                link = self._link
                marks = MarkStore(link.channel, link.open_channel, lambda error: self.events.emit(
                    ev.LoaderMarkUnpublished(error=error)))
            self._loop = OwnLoop(self._engine, total, data, micro_batches, self._fresh_metrics,
                                 marks)
            return self._loop.steps()
        if micro_batches is not None:
            raise UserError("run.steps(micro_batches=...) needs data=: the loop draws them")
        return self._plain_steps(total)

    def try_step(self) -> StepBlock:
        """The block that holds one step of `for step, batch in run.steps(total, data=...)`:
        a peer's fault inside it is recovered in place, and the step runs again."""
        if self._loop is None or self._loop.block is None:
            raise UserError("run.try_step() needs the loop `for step, batch in run.steps(total, "
                            "data=loader):` (a step run again must draw the same batch)")
        return self._loop.block

    def _fresh_metrics(self) -> dict[str, float]:
        self._metrics = {}
        return self._metrics

    def _plain_steps(self, total: int) -> Iterator[int]:
        engine = self._engine
        engine.start_plain(total)
        while (step := engine.begin()) is not None:
            engine.enter(step)
            self._metrics = {}
            yield step
            engine.commit(step, self._metrics)  # the body returned: the step is committed
        engine.finish(checkpoint=True)

    def train(self, step_fn: Callable[[int, Any], Any], steps: int,
              build: Callable[[], Any] | None = None) -> None:
        """Run steps up to `steps`, recovering in place from faults of other workers.

        `step_fn(step, model)` runs one step's forward and backward. `model` is what `build()`
        returned for the current generation (the tracked model if there is no `build`). The
        runtime then checks the step (`anomalies`: the loss given to `run.log(loss=...)` and
        the gradients) and steps the tracked optimizers and schedulers: that update is the
        commit. Raises `JobStopped` when too many anomalies came in a window.
        """
        engine = self._engine
        if steps < 0:
            raise UserError(f"train(steps=...): must be >= 0, got {steps}")
        engine.start(steps, build, step_fn)
        while (step := engine.begin()) is not None:
            self._metrics = {}
            try:
                engine.enter(step)
                step_fn(step, engine.view)
                if engine.check(step, self._metrics) is not Verdict.COMMIT:
                    continue  # rerun, skipped or rolled back: done already
                engine.tracked.update()  # behind the fence (`runtime/generations/fence.py`)
            except Exception as exc:
                engine.fail(step, exc)
                continue
            engine.commit(step, self._metrics)
        engine.finish()

    def close(self) -> None:
        """Tear down what `init` created; safe to call twice."""
        self._engine.close()
        self.events.close()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
    anomalies: AnomalyConfig | None = None,
) -> Run:
    """Join the job: initialise the process group (gloo on CPU, NCCL on GPU) unless the
    script already did, and set up heartbeat, events, faults and checkpoints.

    Checkpoints (async: staged while the next step runs, persisted in the background) are
    taken every `checkpoint_every` steps, or every `checkpoint_every_seconds`, or at the
    Young/Daly interval for the measured checkpoint cost and an expected mean time between
    failures of `checkpoint_mtbf_hours`; and at the end. The newest `keep_checkpoints` are
    kept, and every one whose step is a multiple of `keep_every`. A save not committed within
    `checkpoint_timeout` seconds is reported and skipped over; the loop never waits for it.

    Sharded state (FSDP2, HSDP) under `unbroken run` recovers in place: from a live replica
    (HSDP), or from in-memory snapshots of every rank's shards taken every `snapshot_every`
    steps (None: at most 1 % of step time; 0: none) and copied to `snapshot_replicas` buddies
    (on other nodes, where there are several).

    `anomalies`: the detectors of what does not crash (NaN and loss spikes, silent data
    corruption between replicas, stragglers; docs/anomalies.md), each off by default.

    `seed`: `train()` seeds torch's RNG from (seed, step, slot) before each step, so a step
    redone or run by a replacement draws the same numbers; None leaves the RNG alone.
    """
    return Run(RunConfig(checkpoint_dir, checkpoint_every, keep_checkpoints, backend, timeout, seed,
                         checkpoint_every_seconds=checkpoint_every_seconds,
                         checkpoint_mtbf_hours=checkpoint_mtbf_hours, keep_every=keep_every,
                         checkpoint_timeout=checkpoint_timeout, snapshot_every=snapshot_every,
                         snapshot_replicas=snapshot_replicas,
                         anomalies=anomalies or AnomalyConfig()))
