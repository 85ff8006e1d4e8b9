"""The launcher's typed configuration, filled from `unbroken run`'s flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class LaunchConfig:
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    max_restarts: int = 0
    run_id: str = "default"
    run_dir: Path = Path("unbroken_runs/default")
    module: bool = False
    no_python: bool = False
    redirect: bool = False
    faults: str = ""  # fault spec string handed to workers (see unbroken.faults)
    hang_timeout: float | None = None  # None: calibrated from observed step times
    startup_timeout: float = 600.0  # first heartbeat to first step
    node_timeout: float = 10.0  # an agent silent this long is a lost node
    rdzv_timeout: float = 300.0  # all nodes must join an attempt within this
    kill_grace: float = 3.0  # SIGTERM to SIGKILL when stopping workers
    monitor_interval: float = 0.05
    warm_restarts: bool = True  # keep torch-imported standbys ready for the next attempt
    on_fault: str = "shrink"  # in place: "shrink" or "wait" for the replacement; or "restart"
    recovery_timeout: float = 30.0  # an in-place recovery slower than this falls back to restart
    join_timeout: float = 60.0  # "wait": how long survivors wait for a replacement, then shrink
    spares: int = 0  # hot spares per node: warm processes that take a failed worker's slot
    standby: bool = False  # a standby node: only spares, for lost or drained nodes' ranks
    secret_file: str | None = None  # the job's secret (hex); else UNBROKEN_SECRET, else RUN_DIR/secret

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0 and not self.standby
