"""The node agent: `unbroken run`. One per node; the node-0 agent is the leader.

This module only sets the agent up and picks its role: it serves or connects to the control
store, keeps this agent's liveness lease, handles SIGINT/SIGTERM, and turns the role's end
into an exit code. The roles are `leader.Leader` and `follower.Follower`; both watch their
node's processes through `attempt.AttemptWatch` and `supervisor.NodeSupervisor`. The agent
never imports the user's code.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, TextIO

from unbroken.control.backend import StoreUnavailable
from unbroken.control.channel import Channel
from unbroken.control.messages import Fault
from unbroken.control.schema import agent_lease
from unbroken.control.signing import SECRET_FILE, Signer, load_secret
from unbroken.control.tcp import TcpBackend, connect_store, serve_store
from unbroken.control.worker_env import WorkerEnv
from unbroken.errors import ControlPlaneError
from unbroken.launch.attempt import AttemptWatch
from unbroken.launch.config import LaunchConfig
from unbroken.launch.drain import CONTROL_FILE
from unbroken.launch.follower import Follower
from unbroken.launch.leader import Leader
from unbroken.launch.orphan_guard import OrphanGuard
from unbroken.launch.supervisor import NodeSupervisor
from unbroken.launch.warm_pool import WarmPool
from unbroken.telemetry.event_names import Event
from unbroken.telemetry.events import EVENTS_FILE, EventLog


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Agent:
    def __init__(self, cfg: LaunchConfig, out: TextIO = sys.stderr) -> None:
        self.cfg = cfg
        self.out = out
        self.instance = uuid.uuid4().hex[:12]
        self.events = EventLog(Path(cfg.run_dir) / EVENTS_FILE, source="agent", node=cfg.node_rank)
        self._signal: int | None = None
        self._lease_stop = threading.Event()
        self.role: Leader | Follower | None = None
        self._secret: bytes | None = None

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        cfg = self.cfg
        self.events.emit(
            Event.AGENT_START, run_id=cfg.run_id, pid=os.getpid(), nnodes=cfg.nnodes,
            nproc_per_node=cfg.nproc_per_node, max_restarts=cfg.max_restarts,
            script=cfg.script, args=cfg.script_args, faults=cfg.faults, instance=self.instance,
        )
        self.say(f"run {cfg.run_id}: events in {Path(cfg.run_dir) / EVENTS_FILE}")
        guard, pool, sup = OrphanGuard(), None, None
        try:
            if cfg.warm_restarts and not cfg.no_python:
                pool = WarmPool(cfg.nproc_per_node, self._standby_env(), guard)
            channel, port = self._connect()
            sup = NodeSupervisor(cfg, self.events, self.say, guard, pool, port,
                                 self._secret)
            watch = AttemptWatch(cfg, channel, sup, self.events, self.say, self._check_signal)
            role_cls = Leader if cfg.is_leader else Follower
            self.role = role_cls(cfg, channel, watch, self.events, self.instance, self._sleep,
                                 self._report_failure)
            code = self.role.run()
        except _Interrupted as exc:
            self.say(f"{exc}: stopping workers")
            if sup is not None:
                sup.stop_all()
            self._publish_interrupt(exc.signum)
            code = 128 + exc.signum
        except ControlPlaneError as exc:
            if sup is not None:
                sup.stop_all()
            self.events.emit(Event.AGENT_ERROR, error=str(exc))
            self.events.emit(Event.AGENT_EXIT, code=int(exc.exit_code))
            raise
        finally:
            self._lease_stop.set()  # first: a lease refresh racing shutdown would look lost
            if sup is not None:
                sup.close()
            if pool is not None:
                pool.close()
            guard.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.events.emit(Event.AGENT_EXIT, code=int(code))
        self.events.close()
        return int(code)

    def say(self, msg: str) -> None:
        print(f"[unbroken node {self.cfg.node_rank}] {msg}", file=self.out, flush=True)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal is not None:
            raise _Interrupted(self._signal)

    def _sleep(self, seconds: float = 0.02) -> None:
        time.sleep(seconds)
        self._check_signal()

    # ---------------------------------------------------------------- control plane
    def _forged(self, key: str, why: str) -> None:
        """A control message that fails its signature check: rejected, and reported."""
        self.events.emit(Event.FORGED_MESSAGE, key=key, reason=why)
        self.say(f"rejected a forged control message at {key} ({why})")

    def _job_secret(self) -> bytes:
        """The leader's (made if none is given); a follower waits for the leader's file."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.rdzv_timeout
        while (secret := load_secret(cfg.run_dir, cfg.secret_file, create=cfg.is_leader)) is None:
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"no job secret after {cfg.rdzv_timeout:g}s: give --secret-file or "
                    f"UNBROKEN_SECRET (node 0 writes it to {Path(cfg.run_dir) / SECRET_FILE})")
            self._sleep(0.05)
        return secret

    def _connect(self) -> tuple[Channel, int]:
        """The control channel, and the port the control store listens on."""
        cfg = self.cfg
        self._secret = self._job_secret()
        signer = Signer(self._secret)
        if cfg.is_leader:
            store, port = serve_store(cfg.master_addr, cfg.master_port, cfg.rdzv_timeout)
            backend = TcpBackend(store, cfg.run_id, cfg.master_addr, port)
            # Where `unbroken drain RUN_DIR` finds the job.
            control = Path(cfg.run_dir) / CONTROL_FILE
            control.parent.mkdir(parents=True, exist_ok=True)
            tmp = control.with_suffix(".tmp")
            tmp.write_text(json.dumps({"addr": cfg.master_addr, "port": port, "run_id": cfg.run_id}))
            tmp.replace(control)
            return Channel(backend, signer, self._forged), port
        deadline = time.monotonic() + cfg.rdzv_timeout
        while True:
            self._check_signal()
            try:
                backend = TcpBackend.connect(cfg.master_addr, cfg.master_port, cfg.run_id, 2.0)
                break
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
        threading.Thread(target=self._keep_lease, daemon=True, name="agent-lease").start()
        return Channel(backend, signer, self._forged), cfg.master_port

    def _keep_lease(self) -> None:
        """Proves this agent alive to the leader, on a connection of its own, so that a busy
        main loop cannot stall it. If the store is lost, the main loop sees it at its next call."""
        cfg = self.cfg
        lease = agent_lease(cfg.node_rank, self.instance)
        try:
            backend = TcpBackend(connect_store(cfg.master_addr, cfg.master_port, 10.0), cfg.run_id,
                                 cfg.master_addr, cfg.master_port)
            period = max(0.05, min(1.0, cfg.node_timeout / 5))
            while not self._lease_stop.wait(period):
                backend.refresh_lease(lease.key)
        except ControlPlaneError as exc:
            if not self._lease_stop.is_set():  # not the job's own end
                self.events.emit(Event.LEASE_LOST, error=str(exc))

    def _publish_interrupt(self, signum: int) -> None:
        if self.role is None:
            return
        try:
            self.role.interrupted(signum)
        except ControlPlaneError:
            pass  # the leader is gone too; nothing left to tell

    def _report_failure(self, fault: Fault | None, reason: str | None) -> None:
        where = (f"{fault.where()} {fault.kind.value}: {fault.detail}" if fault is not None
                 else "none")
        self.say(f"giving up after {self.cfg.max_restarts} restart(s): {reason or 'failed'}; "
                 f"last fault was {where}")
        if fault is not None and fault.traceback:
            print(fault.traceback.rstrip(), file=self.out, flush=True)

    def _standby_env(self) -> dict[str, str]:
        """What a standby imports torch under: the workers' environment without rank or attempt."""
        env = dict(os.environ)
        env.update(WorkerEnv(agent_pid=os.getpid(), run_dir=str(Path(self.cfg.run_dir).resolve()),
                             node_rank=self.cfg.node_rank).standby_environ())
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if self.cfg.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        return env
