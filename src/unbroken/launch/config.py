"""The launcher's typed configuration, filled from `unbroken run`'s flags
(`launch.flags`): the job's shape, resolved from several flags, and the groups of settings
that pass through whole (`cfg.recovery`, `cfg.hangs`, `cfg.etcd`, `cfg.telemetry`), declared
once in `launch.flags.groups` with their flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from unbroken.control.address import BackendKind, ControlAddress
from unbroken.control.retry import DEFAULT_WINDOW
from unbroken.launch.flags.groups import Etcd, ExtraNodes, Hangs, Health, Recovery, Telemetry
from unbroken.launch.log_spec import LogSpec

__all__ = ["ExtraNodes", "LaunchConfig"]


@dataclass
class LaunchConfig:
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    """The most nodes that train (`--nnodes N`, or MAX of MIN:MAX)."""
    min_nodes: int | None = None
    """MIN of `--nnodes MIN:MAX`; None: a fixed number of nodes (`nnodes`)."""
    extra_nodes: ExtraNodes = ExtraNodes.JOIN
    last_call: float = 30.0
    """Elastic: seconds to wait for more nodes once MIN have joined (torchrun's
    last_call_timeout), unless the cap is reached first."""
    assign_rank: bool = False
    """The node rank is assigned in join order (torchrun's c10d rendezvous), not given:
    the agent that serves the TCPStore (or claims first, with etcd) is node 0."""
    is_host: bool | None = None
    """`--rdzv-conf is_host`: this agent must (True) or must not (False) serve the store;
    None: whoever can bind the endpoint does."""
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    run_id: str = "default"
    run_dir: Path = Path("unbroken_runs/default")
    module: bool = False
    no_python: bool = False
    logs: LogSpec = field(default_factory=LogSpec)
    """Where the workers' output goes (`--log-dir`, `--redirects`, `--tee`, ...)."""
    role: str = "default"
    """torchrun's `--role`: the workers' ROLE_NAME."""
    signals: tuple[int, ...] = ()
    """`--signals-to-handle`: signals on which the agent stops the workers and exits."""
    virtual_local_rank: bool = False
    """LOCAL_RANK 0 in every worker, CUDA_VISIBLE_DEVICES narrowed to its device."""
    faults: str = ""  # fault spec string handed to workers (see unbroken.faults)
    node_timeout: float = 10.0  # an agent silent this long is a lost node
    rdzv_timeout: float = 300.0  # all nodes must join an attempt within this
    kill_grace: float = 3.0  # SIGTERM to SIGKILL when stopping workers
    standby: bool = False  # a standby node: only spares, for lost or drained nodes' ranks
    secret_file: str | None = None
    """The job's secret (hex) that signs control messages; else UNBROKEN_SECRET; else, on a
    one-node job, RUN_DIR/secret (made by its agent); else none: unsigned (`control.auth`)."""
    backend: BackendKind = BackendKind.TCP
    """The control plane: the node-0 agent's TCPStore, or an etcd cluster (`--rdzv-backend`)."""
    etcd_endpoints: tuple[str, ...] = ()
    """etcd: `--rdzv-endpoint HOST:PORT[,HOST:PORT...]`."""
    local_addr: str | None = None
    """Where this agent binds what it serves (the attempt's worker store, when it leads);
    None: --master-addr with the TCPStore; with etcd the agent sets it, at start, to its
    address on the route to etcd."""
    retry_window: float = DEFAULT_WINDOW
    """How long an agent rides out a lost control plane before it gives up."""
    recovery: Recovery = field(default_factory=Recovery)
    """How faults are recovered from: `--max-restarts`, `--on-fault`, `--spares`, quarantine."""
    hangs: Hangs = field(default_factory=Hangs)
    """When a worker is hung, and how often the agent looks (`--hang-timeout`, ...)."""
    etcd: Etcd = field(default_factory=Etcd)
    """etcd's credentials, and its leader election (`--leader-timeout`, `--continue-dead-job`)."""
    health: Health = field(default_factory=Health)
    """What this node checks before it joins (`--health-check`, `--check-*`)."""
    telemetry: Telemetry = field(default_factory=Telemetry)
    """/metrics and the status lines (`--metrics-port`, `--metrics-addr`, `--status-every`)."""

    @property
    def elastic(self) -> bool:
        """`--nnodes MIN:MAX`: the node set follows who joins."""
        return self.min_nodes is not None and self.min_nodes != self.nnodes

    @property
    def in_place(self) -> bool:
        """Workers using run.train() recover in place (not `--on-fault restart`, and a
        Python script: a --no-python program has no worker runtime)."""
        return self.recovery.on_fault != "restart" and not self.no_python

    @property
    def spares_when_standing_by(self) -> bool:
        """A node outside the plan runs spares (one per device) that take ranks in place:
        a `--standby` node, or with `--extra-nodes standby`. An elastic node beyond the cap
        (torchrun's meaning) runs nothing: it trains from the next restart on."""
        return self.in_place and (self.standby or (self.elastic
                                                   and self.extra_nodes == ExtraNodes.STANDBY))

    @property
    def joins_freely(self) -> bool:
        """The node set is whoever joins (an elastic range, or ranks assigned in join order),
        not ranks 0..N-1 given on the command line."""
        return self.elastic or self.assign_rank

    @property
    def cap(self) -> int:
        """The most nodes that train at once."""
        if self.elastic and self.extra_nodes == ExtraNodes.STANDBY:
            return self.min_nodes
        return self.nnodes

    @property
    def least(self) -> int:
        """The fewest nodes the job trains on."""
        return self.min_nodes if self.min_nodes is not None else self.nnodes

    @property
    def single_node(self) -> bool:
        """A one-node job (`--nnodes 1`, no standby node): no other host ever joins, so
        its agent may make the job's secret itself and keep it in its run dir."""
        return self.nnodes == 1 and not self.elastic and not self.standby and not self.assign_rank

    @property
    def is_leader(self) -> bool:
        """Node 0 leads from the start (with etcd, it stands first; any agent may take over)."""
        return self.node_rank == 0 and not self.standby

    @property
    def quiet_poll(self) -> float:
        """Seconds between control-plane reads while the node is quiet (`AttemptWatch`):
        0.25 s on etcd (where the watch's copy answers them: no request); on the TCPStore,
        2 ms per node up to 0.5 s, so that the one store serves a bounded number of looks
        a second however many agents poll it (every look below 25 nodes)."""
        if self.backend == BackendKind.ETCD:
            return 0.25
        return min(0.5, 0.002 * self.nnodes) if self.nnodes > 25 else 0.0

    @property
    def bind_addr(self) -> str:
        if self.local_addr:
            return self.local_addr
        return self.master_addr if self.backend == BackendKind.TCP else "127.0.0.1"  # unset yet

    def lease_period(self, leading: bool) -> float:
        """How often an agent refreshes its lease: five times within the timeout it is
        judged by (a leader's, --leader-timeout, when elected; else --node-timeout)."""
        timeout = self.etcd.leader_timeout if leading and self.elects else self.node_timeout
        return max(0.05, min(2.0, timeout / 5))

    @property
    def elects(self) -> bool:
        """Leadership is elected (etcd), not fixed on node 0 (TCPStore)."""
        return self.backend == BackendKind.ETCD

    def control_address(self, port: int) -> ControlAddress:
        """Where agents, workers and `unbroken drain` reach the control plane."""
        if self.backend == BackendKind.ETCD:
            return ControlAddress(BackendKind.ETCD, self.etcd_endpoints, self.etcd.credentials)
        return ControlAddress(BackendKind.TCP, (f"{self.master_addr}:{port}",))
