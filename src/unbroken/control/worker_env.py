"""The agent-to-worker contract: the environment a worker is started with, declared once.

The agent builds it (`WorkerEnv.to_environ`) and the worker runtime reads it
(`WorkerEnv.from_environ`); nothing else names these variables. Under plain `torchrun` or in
a single process only torchrun's variables are set, and the unbroken fields keep their
defaults (no agent: no control channel, no heartbeat, no in-place recovery).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


def node_dir(run_dir: str | os.PathLike[str], node_rank: int) -> Path:
    """A node's part of the run dir: its attempts' heartbeats and errors, its module list."""
    return Path(run_dir) / f"node_{node_rank}"


class Role(StrEnum):
    WORKER = "worker"
    SPARE = "spare"  # warms up, then waits to be promoted into a slot


JOB_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
})
"""torchrun's per-rank and per-job variables (`to_environ` sets them for each worker; the
fork server has none): a module that reads one at import is never imported ahead of time,
since it would keep what it saw in the server (`warm_imports.Preimporter`)."""


@dataclass
class WorkerEnv:
    rank: int = 0
    """The global rank at the start of the attempt (-1 for a spare, until promoted)."""
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    """This node's rank: the agent's (given, or its place in join order)."""
    group_rank: int | None = None
    """torchrun's GROUP_RANK: the node's place in this attempt's plan (dense, 0..nnodes-1);
    None: `node_rank`."""
    nnodes: int = 1
    attempt: int = 0
    """The attempt (torchrun's restart count)."""
    max_restarts: int = 0
    run_id: str = "default"
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    """The attempt's worker store (a fresh port per attempt under `unbroken run`)."""
    run_dir: str | None = None
    """Events, heartbeats and logs: set only under `unbroken run`."""
    heartbeat_file: str | None = None
    error_file: str | None = None
    torchelastic_error_file: str | None = None
    agent_pid: int | None = None
    control: str | None = None
    """The control plane (`address.ControlAddress.text()`): set only under `unbroken run`.
    etcd credentials travel as `EtcdCredentials.to_environ()` beside it."""
    departures_socket: str | None = None
    """Where the worker posts its departures for its agent to gather
    (`control/departure_post.py`); None: it writes them to the store itself."""
    faults: str = ""
    """Fault injection spec (`unbroken.faults`)."""
    in_place: bool = False
    """The agent runs in-place recovery (`--on-fault` shrink or wait)."""
    recovery_timeout: float = 60.0
    """A worker's own bound on waiting for a plan: past every bound of the leader's."""
    slot: int | None = None
    """The logical slot (the original rank, which a replacement inherits); None: the rank."""
    worker_id: str | None = None
    """"<slot>.<incarnation>", or a spare's "spare<node>-<n>"."""
    joining: bool = False
    """A replacement: it registers as a joiner instead of starting the job."""
    role: Role = Role.WORKER
    shadow_steps: int = 3
    """A spare's warm-up iterations."""
    retry_window: float = 30.0
    """How long a lost control plane is retried before it is an error (`--control-retry-window`)."""
    secret: str | None = None
    """The job's secret, in hex: signs and checks control messages."""
    agent_store: bool = False
    """torchrun's TORCHELASTIC_USE_AGENT_STORE: workers rendezvous in the agent's store."""
    role_name: str = "default"
    """torchrun's `--role` (ROLE_NAME)."""
    integrations: bool = True
    """The framework integrations protect what the script trains (`--no-integrations`)."""
    exact_reduction: bool = False
    """A framework integration sums gradients in rank order (`--exact-reduction`)."""
    record_imports: bool = False
    """The node keeps warm interpreters: list this worker's modules for them (`warm_imports`)."""
    device: str | None = None
    """`--virtual-local-rank`: this worker's one visible device (CUDA_VISIBLE_DEVICES), and
    LOCAL_RANK is 0; None: LOCAL_RANK is the local rank, and the devices are left alone."""

    @property
    def under_agent(self) -> bool:
        return self.control is not None

    def to_environ(self) -> dict[str, str]:
        """The variables, torchrun's and ours, for `os.environ`."""
        env = {
            # The same variables torchrun sets, so unmodified torchrun scripts run as they are.
            "RANK": self.rank, "LOCAL_RANK": self.local_rank if self.device is None else 0,
            "WORLD_SIZE": self.world_size, "CUDA_VISIBLE_DEVICES": self.device,
            "LOCAL_WORLD_SIZE": self.local_world_size, "GROUP_RANK": self.node_rank if self.group_rank is None else self.group_rank,
            "GROUP_WORLD_SIZE": self.nnodes, "ROLE_RANK": self.rank,
            "ROLE_WORLD_SIZE": self.world_size, "ROLE_NAME": self.role_name,
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": self.master_port,
            "TORCHELASTIC_RESTART_COUNT": self.attempt,
            "TORCHELASTIC_MAX_RESTARTS": self.max_restarts, "TORCHELASTIC_RUN_ID": self.run_id,
            # Workers connect to the agent's per-attempt store as clients; no worker hosts it.
            "TORCHELASTIC_USE_AGENT_STORE": "True" if self.agent_store else None,
            "TORCHELASTIC_ERROR_FILE": self.torchelastic_error_file,
            "UNBROKEN_RUN_ID": self.run_id, "UNBROKEN_RUN_DIR": self.run_dir,
            "UNBROKEN_NODE_RANK": self.node_rank, "UNBROKEN_ATTEMPT": self.attempt,
            "UNBROKEN_HEARTBEAT_FILE": self.heartbeat_file,
            "UNBROKEN_ERROR_FILE": self.error_file, "UNBROKEN_AGENT_PID": self.agent_pid,
            "UNBROKEN_CONTROL": self.control, "UNBROKEN_FAULTS": self.faults,
            "UNBROKEN_DEPARTURES_SOCKET": self.departures_socket,
            "UNBROKEN_IN_PLACE": "1" if self.in_place else "0",
            "UNBROKEN_RECOVERY_TIMEOUT": self.recovery_timeout,
            "UNBROKEN_SLOT": self.slot, "UNBROKEN_WORKER_ID": self.worker_id,
            "UNBROKEN_JOIN": "1" if self.joining else "0", "UNBROKEN_ROLE": self.role.value,
            "UNBROKEN_SHADOW_STEPS": self.shadow_steps, "UNBROKEN_SECRET": self.secret,
            "UNBROKEN_RETRY_WINDOW": self.retry_window,
            "UNBROKEN_RECORD_IMPORTS": "1" if self.record_imports else "0",
            "UNBROKEN_INTEGRATIONS": "1" if self.integrations else "0",
            "UNBROKEN_EXACT_REDUCTION": "1" if self.exact_reduction else "0",
        }
        return {k: str(v) for k, v in env.items() if v is not None}

    def server_environ(self) -> dict[str, str]:
        """What the node's fork server starts with: where to log and whose child it is, no
        rank and no attempt (each worker it forks gets `to_environ()`)."""
        env = {"UNBROKEN_AGENT_PID": self.agent_pid, "UNBROKEN_RUN_DIR": self.run_dir,
               "UNBROKEN_NODE_RANK": self.node_rank}
        return {k: str(v) for k, v in env.items() if v is not None}

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if env is None else env

        def num(name: str, default: int | None, *fallbacks: str) -> int | None:
            for key in (name, *fallbacks):
                if env.get(key):
                    return int(env[key])
            return default

        control = env.get("UNBROKEN_CONTROL") or None
        return cls(
            rank=num("RANK", 0), world_size=num("WORLD_SIZE", 1),
            local_rank=num("LOCAL_RANK", 0), local_world_size=num("LOCAL_WORLD_SIZE", 1),
            node_rank=num("UNBROKEN_NODE_RANK", 0, "GROUP_RANK"),
            nnodes=num("GROUP_WORLD_SIZE", 1),
            attempt=num("UNBROKEN_ATTEMPT", 0, "TORCHELASTIC_RESTART_COUNT"),
            max_restarts=num("TORCHELASTIC_MAX_RESTARTS", 0),
            run_id=env.get("UNBROKEN_RUN_ID", env.get("TORCHELASTIC_RUN_ID", "default")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=num("MASTER_PORT", 29500),
            run_dir=env.get("UNBROKEN_RUN_DIR"), heartbeat_file=env.get("UNBROKEN_HEARTBEAT_FILE"),
            error_file=env.get("UNBROKEN_ERROR_FILE"),
            torchelastic_error_file=env.get("TORCHELASTIC_ERROR_FILE"),
            agent_pid=num("UNBROKEN_AGENT_PID", None),
            control=control,
            departures_socket=env.get("UNBROKEN_DEPARTURES_SOCKET") or None,
            faults=env.get("UNBROKEN_FAULTS", ""),
            in_place=env.get("UNBROKEN_IN_PLACE") == "1" and control is not None,
            recovery_timeout=float(env.get("UNBROKEN_RECOVERY_TIMEOUT", 60)),
            slot=num("UNBROKEN_SLOT", None), worker_id=env.get("UNBROKEN_WORKER_ID"),
            joining=env.get("UNBROKEN_JOIN") == "1",
            role=Role(env.get("UNBROKEN_ROLE", Role.WORKER.value)),
            shadow_steps=num("UNBROKEN_SHADOW_STEPS", 3),
            retry_window=float(env.get("UNBROKEN_RETRY_WINDOW", 30)),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            secret=env.get("UNBROKEN_SECRET"), role_name=env.get("ROLE_NAME", "default"),
            record_imports=env.get("UNBROKEN_RECORD_IMPORTS") == "1",
            integrations=env.get("UNBROKEN_INTEGRATIONS", "1") == "1",
            exact_reduction=env.get("UNBROKEN_EXACT_REDUCTION") == "1",
        )
