"""The worker API: `unbroken.init()` returns a `Run`, whose step iterator owns the step counter.

    run = unbroken.init(checkpoint_dir="ckpt", checkpoint_every=20)
    model = DDP(GPT(cfg)); optimizer = torch.optim.AdamW(model.parameters())
    run.track(model, optimizer)              # what a checkpoint saves and a restart restores
    for step in run.steps(1000):             # resumes after the last committed step
        x, y = batch(step, run.rank, run.world_size)   # data is a function of the step
        loss = loss_fn(model(x), y); loss.backward()
        optimizer.step(); optimizer.zero_grad()
        run.log(loss=loss)

A step is committed when its loop body returns. The runtime stamps the heartbeat, fires
injected faults, records each step's duration and metrics, and checkpoints on schedule.
It works under `unbroken run`, under `torchrun`, and in a single plain process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from unbroken.checkpoint.checkpointer import Checkpointer
from unbroken.errors import UserError
from unbroken.faults.inject import FaultInjector
from unbroken.faults.spec import parse_faults
from unbroken.runtime.heartbeat import (
    PHASE_CHECKPOINT,
    PHASE_DONE,
    PHASE_TRAINING,
    HeartbeatWriter,
)
from unbroken.telemetry.events import EVENTS_FILE, EventLog


def _process_start_time() -> float | None:
    """Wall-clock time this process was started (Linux), to time imports and set-up."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


class Run:
    """One worker's view of the job; create it with `unbroken.init()`."""

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 3,
        backend: str | None = None,
        timeout: float = 1800.0,
    ) -> None:
        if checkpoint_every is not None and checkpoint_every < 1:
            raise UserError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        env = os.environ
        self.rank = int(env.get("RANK", 0))
        self.world_size = int(env.get("WORLD_SIZE", 1))
        self.local_rank = int(env.get("LOCAL_RANK", 0))
        self.attempt = int(env.get("UNBROKEN_ATTEMPT", env.get("TORCHELASTIC_RESTART_COUNT", 0)))
        run_dir = env.get("UNBROKEN_RUN_DIR")
        self.events = EventLog(
            Path(run_dir) / EVENTS_FILE if run_dir else None, source="worker",
            node=int(env.get("UNBROKEN_NODE_RANK", env.get("GROUP_RANK", 0))),
            rank=self.rank, attempt=self.attempt,
        )
        hb_file = env.get("UNBROKEN_HEARTBEAT_FILE")
        self._heartbeat = HeartbeatWriter(hb_file) if hb_file else None

        t0 = time.monotonic()
        self._owns_group = False
        if self.world_size > 1 and not dist.is_initialized():
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(self.local_rank)
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout))
            self._owns_group = True
        # Checkpoint collectives get a group of their own, never the training one.
        self._ckpt_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        pg_seconds = time.monotonic() - t0
        started = _process_start_time()
        self.events.emit(
            "worker_start", pid=os.getpid(), world_size=self.world_size,
            startup=round(time.time() - started, 6) if started else None,
            process_group=round(pg_seconds, 6),
        )

        self._checkpointer = (
            Checkpointer(checkpoint_dir, group=self._ckpt_group, keep=keep_checkpoints,
                         attempt=self.attempt, record=self.events.emit)
            if checkpoint_dir else None
        )
        self.checkpoint_every = checkpoint_every if checkpoint_dir else None
        self._faults = FaultInjector(
            parse_faults(env.get("UNBROKEN_FAULTS")), self.rank, self._claim_fault, self.events.emit
        )
        self._control = None
        self._claimed_here: set[str] = set()
        self._model: torch.nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._extra: dict[str, Any] = {}
        self._metrics: dict[str, float] = {}
        self.step = 0  # the next step to run; equals the number of committed steps

    # ------------------------------------------------------------------ faults
    def _claim_fault(self, key: str) -> bool:
        """A fault fires once per job: claimed in the control store, or per process without one."""
        port = os.environ.get("UNBROKEN_CONTROL_PORT")
        if port:
            if self._control is None:
                from unbroken.launch.control_store import ControlStore, connect_store

                store = connect_store(os.environ["UNBROKEN_CONTROL_ADDR"], int(port), 30.0)
                self._control = ControlStore(store, os.environ.get("UNBROKEN_RUN_ID", "default"))
            return self._control.claim(f"fault/{key}")
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
        torch.set_rng_state(state["unbroken"]["rng_cpu"])
        self.step = int(state["unbroken"]["step"])

    def save_checkpoint(self) -> None:
        """Checkpoint the committed state now (collective: every rank must call it)."""
        if self._checkpointer is None:
            raise UserError("no checkpoint_dir was given to unbroken.init()")
        self._stamp(self.step, PHASE_CHECKPOINT)
        self._checkpointer.save(self.state_dict(), self.step)
        self._stamp(self.step, PHASE_TRAINING)

    def _resume(self) -> None:
        if self._checkpointer is None:
            return
        self._stamp(self.step, PHASE_CHECKPOINT)
        state = self.state_dict()
        loaded = self._checkpointer.load_latest(state)
        if loaded is not None:
            self._restore(state)
        self._stamp(self.step, PHASE_TRAINING)

    # ------------------------------------------------------------------ the loop
    def _stamp(self, step: int, phase: int) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stamp(step, phase)

    def log(self, **metrics: Any) -> None:
        """Attach metrics (floats or one-element tensors) to the current step's event."""
        for name, value in metrics.items():
            self._metrics[name] = float(value.item() if isinstance(value, torch.Tensor) else value)

    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps still to run, from the last committed one up to `total`."""
        if total < 0:
            raise UserError(f"steps(total): total must be >= 0, got {total}")
        if self._checkpointer is not None and self._model is None:
            raise UserError("call run.track(model, optimizer) before run.steps() to checkpoint")
        self._resume()
        self.events.emit("resume", step=self.step, total=total)
        while self.step < total:
            step = self.step
            self._stamp(step, PHASE_TRAINING)
            self._faults.at_step(step)
            self._metrics = {}
            t0 = time.perf_counter()
            yield step
            duration = time.perf_counter() - t0
            self.step = step + 1  # the body returned: the step is committed
            self.events.emit("step", step=step, duration=round(duration, 6), **self._metrics)
            every = self.checkpoint_every
            if every and (self.step % every == 0 or self.step == total):
                self.save_checkpoint()
        self._stamp(self.step, PHASE_DONE)
        self.events.emit("training_done", step=self.step)

    def close(self) -> None:
        """Tear down what `init` created; safe to call twice."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
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
) -> Run:
    """Join the job: initialise the process group (gloo on CPU, NCCL on GPU) unless the
    script already did, and set up heartbeat, events, faults and checkpoints."""
    return Run(checkpoint_dir, checkpoint_every, keep_checkpoints, backend, timeout)
