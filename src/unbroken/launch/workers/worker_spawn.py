"""Starting this node's processes: a worker for a slot, or a spare. Each gets its environment
(the `WorkerEnv` contract, the etcd credentials, a launcher's defaults), its command, its log
streams, a fork of the node's fork server when it has one (else a fresh interpreter), and
its own process group under the orphan guard; it comes back as a `WorkerProcess` ready to be watched.

The spawner keeps no list of processes and watches none: `supervisor.NodeSupervisor` does.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path

from unbroken.control import nccl_env
from unbroken.control.address import ControlAddress
from unbroken.control.messages import AttemptPlan
from unbroken.control.worker_env import Role, WorkerEnv
from unbroken.launch.config import LaunchConfig
from unbroken.launch.workers.fork_client import ForkedProcess, ForkServer
from unbroken.launch.workers.hang_detector import HangDetector
from unbroken.launch.workers.heartbeat_reader import HeartbeatReader
from unbroken.launch.workers.orphan_guard import OrphanGuard
from unbroken.launch.workers.worker_logs import AttemptLogs, Tailer, WorkerStreams
from unbroken.launch.workers.worker_process import (
    WorkerProcess,
    open_pidfd,
    script_argv,
    spawn,
    worker_command,
)


class WorkerSpawner:
    """Starts workers and spares of one node (see the module's docstring). `control` is
    where the workers reach the control plane; `secret` is handed to them (they sign and
    check control messages); `node_dir` holds their heartbeat and error files."""

    def __init__(self, cfg: LaunchConfig, guard: OrphanGuard, forks: ForkServer | None,
                 control: ControlAddress, secret: bytes | None, node_dir: Path,
                 logs: AttemptLogs, tailer: Tailer, departures_socket: str | None = None,
                 ) -> None:
        self.cfg = cfg
        self.departures_socket = departures_socket  # the agent's `DepartureRelay`
        self.guard = guard
        self.forks = forks  # the node's fork server; None: every process starts cold
        self.control = control
        self.secret = secret
        self.node_dir = node_dir
        self.logs = logs
        self.tailer = tailer
        self._shadow_steps = WorkerEnv.from_environ().shadow_steps  # a user's setting is kept

    def worker(self, plan: AttemptPlan, attempt: int, rank: int, local_rank: int, wid: str,
               joining: bool) -> WorkerProcess:
        """Start one worker of `plan` (forked by the node's server when it can)."""
        incarnation = wid.split(".")[1]
        name = f"rank_{rank}" if incarnation == "0" else f"rank_{rank}-r{incarnation}"
        base = self.node_dir / f"attempt_{attempt}" / name
        streams = self.logs.streams(attempt, rank, local_rank)
        if streams.error_file:  # a replacement's file: its predecessor's error is not its own
            Path(streams.error_file).unlink(missing_ok=True)
        env = self._env(plan, attempt, rank, local_rank, base, slot=rank, worker_id=wid,
                        joining=joining, error_file=streams.error_file)
        proc = self._start(env, streams)
        self.tailer.follow(streams)
        worker = self._process(proc, rank, local_rank, base, wid)
        worker.torchelastic_error_file = Path(env["TORCHELASTIC_ERROR_FILE"])
        return worker

    def spare(self, plan: AttemptPlan, attempt: int, local_rank: int, wid: str) -> WorkerProcess:
        """A hot spare: the user's script in the spare role, warming up at idle priority, on
        the device of `local_rank`."""
        cfg = self.cfg
        base = self.node_dir / f"attempt_{attempt}" / wid
        env = self._env(plan, attempt, -1, local_rank, base, slot=-1, worker_id=wid,
                        joining=True, role=Role.SPARE)
        # A spare is no rank yet: its output goes to its own file once worker logs go to files.
        log = str(base.with_suffix(".log")) if cfg.logs.uses_dir else None
        proc = self._start(env, WorkerStreams(stdout=log, stderr=log))
        _idle_priority(proc.pid)
        return self._process(proc, -1, local_rank, base, wid)

    def _start(self, env: dict[str, str],
               streams: WorkerStreams | None) -> subprocess.Popen | ForkedProcess:
        """Forked by the server, else a fresh interpreter; its process group watched by the
        orphan guard (the process and its children)."""
        cfg = self.cfg
        argv = script_argv(cfg.script, cfg.script_args, cfg.module)
        proc = self.forks.spawn(env, argv, streams) if self.forks is not None else None
        if proc is None:
            proc = spawn(worker_command(cfg.script, cfg.script_args, cfg.module, cfg.no_python),
                         env, streams)
        self.guard.watch(proc.pid)
        return proc

    def hang_detector(self) -> HangDetector:
        """A fresh hang detector for a worker that takes a slot."""
        return HangDetector(self.cfg.hangs.hang_timeout, self.cfg.hangs.startup_timeout,
                            floor=self.cfg.hangs.hang_floor)

    def _process(self, proc: subprocess.Popen | ForkedProcess, rank: int, local_rank: int, base: Path,
                 wid: str) -> WorkerProcess:
        w = WorkerProcess(rank=rank, local_rank=local_rank, proc=proc,
                          heartbeat=HeartbeatReader(base.with_suffix(".hb")),
                          hang=self.hang_detector(),
                          error_file=base.with_suffix(".error.json"), wid=wid)
        w.pidfd = open_pidfd(proc.pid)
        return w

    def _env(self, plan: AttemptPlan, attempt: int, rank: int, local_rank: int, base: Path,
             error_file: str | None = None, **fields) -> dict[str, str]:  # noqa: ANN003
        """`error_file`: torchrun's error.json in the log layout; None: one in the node dir."""
        cfg = self.cfg
        contract = WorkerEnv(
            rank=rank, world_size=plan.world_size, local_rank=local_rank,
            local_world_size=cfg.nproc_per_node, node_rank=cfg.node_rank, nnodes=len(plan.nodes),
            group_rank=list(plan.nodes).index(cfg.node_rank) if cfg.node_rank in plan.nodes
            else None,
            attempt=attempt, max_restarts=cfg.recovery.max_restarts, run_id=cfg.run_id,
            master_addr=plan.worker_addr or cfg.master_addr, master_port=plan.worker_port,
            run_dir=str(Path(cfg.run_dir).resolve()), heartbeat_file=str(base.with_suffix(".hb")),
            error_file=str(base.with_suffix(".error.json")),
            torchelastic_error_file=error_file or str(base.with_suffix(".torchelastic.json")),
            role_name=cfg.role, device=self._device(local_rank),
            record_imports=self.forks is not None, integrations=cfg.recovery.integrations,
            exact_reduction=cfg.recovery.exact_reduction,
            agent_pid=os.getpid(), control=self.control.text(), retry_window=cfg.retry_window,
            departures_socket=self.departures_socket,
            shadow_steps=self._shadow_steps,
            secret=self.secret.hex() if self.secret else None,
            faults=cfg.faults, in_place=cfg.recovery.on_fault != "restart",
            recovery_timeout=2 * cfg.recovery.recovery_timeout + cfg.recovery.join_timeout,
            agent_store=True,
            **fields)
        env = dict(os.environ)
        env.update(contract.to_environ())
        env.update(self.control.credentials.to_environ())
        return launcher_defaults(env, cfg)

    def _device(self, local_rank: int) -> str | None:
        """`--virtual-local-rank`: the one device this worker sees (its local rank's)."""
        if not self.cfg.virtual_local_rank:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(self.cfg.nproc_per_node)]
        return devices[local_rank] if local_rank < len(devices) else str(local_rank)


def launcher_defaults(env: dict[str, str], cfg: LaunchConfig) -> dict[str, str]:
    """The variables a launcher sets: one thread per worker when several share a node unless
    the user set it, as torchrun does; NCCL's, in place, whatever the user set
    (`control/nccl_env.py`: torch must never kill or stall a survivor; the agent says at its
    start which values of the user's it overrides: `nccl_overrides`), otherwise torchrun's
    error handling (1, TearDown) unless the user set it."""
    env.update(nccl_env.needed(env, cfg.in_place, torch_version())[0])
    if cfg.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # no oversubscription
    return env


def nccl_overrides(cfg: LaunchConfig) -> list[str]:
    """One line for each NCCL variable of the user's that `launcher_defaults` overrides."""
    return nccl_env.needed(os.environ, cfg.in_place, torch_version())[1]


def torch_version() -> str:
    """The installed torch's version, without importing torch (the agent never does)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _idle_priority(pid: int) -> None:
    """A spare warms up on CPU that training leaves idle (SCHED_IDLE; needs root)."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass  # not permitted: it warms up at normal priority
