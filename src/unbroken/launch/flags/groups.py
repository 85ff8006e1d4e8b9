"""The typed groups of `unbroken run`'s flags. Each field is one flag, declared once: its
spellings, help, value parser and `PET_` variable (`declare.flag`). Each group checks its
own fields in `__post_init__` and says a user's mistake in one line (`UserError`); checks
across groups are `resolve.py`'s.

torchrun's flags keep torchrun's names, defaults and meaning (`torchrun=True` also takes
the underscore spelling); where one cannot apply it is accepted, and `resolve.py` says in
one line what unbroken does instead. unbroken's own flags never take a torchrun flag's
name (argparse also accepts unambiguous prefixes, so `--redirect 3` is torchrun's
`--redirects 3` here too). docs/torchrun-migration.md lists each flag.

`Recovery`, `Hangs`, `Telemetry` and `Etcd` are kept whole in the `LaunchConfig`
(`cfg.recovery.max_restarts`); `Rendezvous`, `Workers` and `Logs` are resolved into its
job shape and its `LogSpec`.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from unbroken.errors import UserError
from unbroken.faults import FAULT_KINDS, parse_faults
from unbroken.launch.flags.declare import Kind, flag
from unbroken.launch.flags.values import (
    NodeRange,
    comma_list,
    nproc,
    parse_nnodes,
    parse_rdzv_conf,
    parse_signals,
    port,
    positive_float,
    seconds,
    seconds_or_zero,
    size_bytes,
)
from unbroken.launch.log_spec import (
    PREFIX_TEMPLATE_VAR,
    LogSpec,
    parse_ranks_filter,
    parse_std,
)
from unbroken.launch.planning.node_set import QuarantineRule

if TYPE_CHECKING:
    from unbroken.control.address import EtcdCredentials

COMPLETION_SHELLS = ("bash", "zsh", "tcsh")
"""torchrun's `--print-completion` shells (torch 2.15; shtab's, when shtab is installed)."""

ETCD_BACKENDS = ("etcd", "etcd-v2")


class ExtraNodes(StrEnum):
    """With `--nnodes MIN:MAX`: what the nodes beyond MIN do."""

    JOIN = "join"
    """torchrun's meaning: they train too, up to MAX; the world size follows the node count."""
    STANDBY = "standby"
    """NVRx ft_launcher's meaning: exactly MIN nodes train; the others stand by with spares
    and take a lost node's ranks, so the world never changes size."""


@dataclass(frozen=True)
class Rendezvous:
    """Rendezvous and the control plane: which nodes form the job, and where they meet."""

    nnodes: str = flag("--nnodes", default="1", help="number of nodes: N, or MIN:MAX for an "
                       "elastic job (torchrun's meaning by default; see --extra-nodes)")
    """`N` or `MIN:MAX`, as given (`node_range` reads it)."""
    rdzv_backend: str = flag(
        "--rdzv-backend", torchrun=True, default="c10d",
        choices=("c10d", "static", "etcd", "etcd-v2"),
        help="c10d/static: one agent holds the control store (that host is a single point of "
             "failure); etcd/etcd-v2: the control plane is an etcd v3 cluster and any agent "
             "can take over as leader")
    rdzv_endpoint: str | None = flag(
        "--rdzv-endpoint", torchrun=True,
        help="c10d: HOST:PORT, the same as --master-addr/--master-port; etcd: the etcd "
             "cluster, HOST:PORT[,HOST:PORT...] (https://HOST:PORT for TLS)")
    run_id: str | None = flag("--rdzv-id", "--rdzv_id", "--run-id", "--run_id", pet="PET_RDZV_ID",
                              help="job id, the same on every node (default: generated on one "
                                   "node)")
    """None (or torchrun's "none"): generated on one node, "default" on several."""
    rdzv_conf: str = flag("--rdzv-conf", torchrun=True, default="",
                          help="KEY=VALUE,...: join_timeout, last_call_timeout, "
                               "keep_alive_interval, keep_alive_max_attempt, is_host (see the "
                               "migration page)")
    standalone: bool = flag("--standalone", kind=Kind.SWITCH, default=False,
                            help="single node on a free loopback port (as torchrun --standalone)")
    node_rank: int | None = flag("--node-rank", torchrun=True, parse=int,
                                 help="this node's rank (default: 0 for one node; assigned in "
                                      "join order otherwise)")
    master_addr: str | None = flag("--master-addr", torchrun=True, help="address of the agent "
                                   "that holds the control store; default 127.0.0.1")
    master_port: int | None = flag("--master-port", torchrun=True, parse=port,
                                   help="port of that control store (default 29500)")
    local_addr: str | None = flag(
        "--local-addr", torchrun=True,
        help="this node's address, where it serves the workers' store when it leads "
             "(default: --master-addr, or 127.0.0.1 with etcd)")
    extra_nodes: str = flag(
        "--extra-nodes", choices=tuple(ExtraNodes), default="join",
        help="with --nnodes MIN:MAX: nodes beyond MIN join the job up to MAX (join: torchrun's "
             "meaning), or stand by with spares that take a lost node's ranks, so that the "
             "world stays MIN nodes (standby: NVRx ft_launcher's meaning)")
    standby: bool = flag(
        "--standby", kind=Kind.SWITCH, default=False,
        help="join a running multi-node job as a standby node: every process is a spare, and "
             "they take over a lost node's or a drained node's ranks; give a --node-rank of "
             "--nnodes or more, or none (it claims a standby id: 100, 101, ...)")
    retry_window: float = flag("--control-retry-window", parse=seconds, default=30.0,
                               pet="PET_CONTROL_RETRY_WINDOW", metavar="CONTROL_RETRY_WINDOW",
                               help="seconds an agent retries a lost control plane before "
                                    "giving up")
    node_timeout: float | None = flag("--node-timeout", parse=seconds, help="seconds of agent "
                                      "silence before its node is lost (default 10)")
    rdzv_timeout: float | None = flag(
        "--rdzv-timeout", parse=seconds,
        help="seconds for the nodes to join an attempt (default 300; torchrun's --rdzv-conf "
             "join_timeout sets it too)")
    run_dir: str | None = flag("--run-dir", help="where events, heartbeats and worker logs go "
                               "(default unbroken_runs/RUN_ID)")
    secret_file: str | None = flag(
        "--secret-file", metavar="PATH",
        help="the job's secret, in hex, that signs every control message, the same on every "
             "node (default: UNBROKEN_SECRET; else a one-node job makes its own, and a "
             "multi-node job runs unsigned and says so)")

    def __post_init__(self) -> None:
        nodes = self.node_range
        parse_rdzv_conf(self.rdzv_conf, lambda _: None)  # a malformed one fails here
        if self.extra_nodes == ExtraNodes.STANDBY and not nodes.elastic:
            raise UserError("--extra-nodes standby needs --nnodes MIN:MAX (nodes beyond MIN "
                            "stand by)")
        if nodes.elastic and self.rdzv_backend == "static":
            raise UserError(f"--nnodes {self.nnodes}: the static rendezvous takes a fixed "
                            "number of nodes; use --rdzv-backend c10d or etcd for a range")
        if nodes.elastic and self.standby:
            raise UserError("--standby is for a fixed --nnodes; with a range, nodes beyond MAX "
                            "(or beyond MIN with --extra-nodes standby) stand by on their own")
        if self.etcd:
            if not self.rdzv_endpoint:
                raise UserError(f"--rdzv-backend {self.rdzv_backend} needs --rdzv-endpoint "
                                "HOST:PORT[,HOST:PORT...] naming the etcd cluster")
            if self.standalone:
                raise UserError("--standalone serves its own store; drop it or --rdzv-backend "
                                "etcd")
        if self.standalone and nodes.max != 1:
            raise UserError("--standalone is for a single node; drop it or --nnodes")
        run_id = self.run_id
        if run_id not in (None, "none") and not all(c.isalnum() or c in "-_." for c in run_id):
            raise UserError(f"--rdzv-id may hold letters, digits, '-', '_' and '.', got {run_id!r}")

    @property
    def node_range(self) -> NodeRange:
        return parse_nnodes(self.nnodes)

    @property
    def etcd(self) -> bool:
        return self.rdzv_backend in ETCD_BACKENDS


@dataclass(frozen=True)
class Etcd:
    """Etcd: the control plane's credentials, and its leader election."""

    etcd_cacert: str | None = flag("--etcd-cacert", metavar="PATH",
                                   help="CA that signed etcd's TLS certificate")
    etcd_cert: str | None = flag("--etcd-cert", metavar="PATH",
                                 help="client certificate, for etcd with --client-cert-auth")
    etcd_key: str | None = flag("--etcd-key", metavar="PATH", help="the client certificate's key")
    etcd_user: str | None = flag("--etcd-user", help="etcd user; its password is read from "
                                 "UNBROKEN_ETCD_PASSWORD")
    leader_timeout: float = flag("--leader-timeout", parse=seconds, default=2.0,
                                 help="etcd: seconds of leader silence before another agent "
                                      "takes over")
    """A leader whose lease is silent this long is replaced."""
    continue_dead_job: bool = flag(
        "--continue-dead-job", kind=Kind.SWITCH, default=False,
        help="etcd: if the control plane holds the keys of a dead job under this --rdzv-id (no "
             "leader alive), clear them and start this job under it: the training resumes "
             "from its checkpoints (default: refuse, saying so; `unbroken k8s` passes it, its "
             "ids being unique to a JobSet)")
    """Keys of a dead job found under this id (`launch.dead_job`) are cleared and the job
    formed afresh under it, instead of refused."""

    def __post_init__(self) -> None:
        for path in (self.etcd_cacert, self.etcd_cert, self.etcd_key):
            if path and not Path(path).is_file():
                raise UserError(f"file not found: {path}")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise UserError("--etcd-cert and --etcd-key go together")

    @property
    def credentials(self) -> EtcdCredentials:
        from unbroken.control.address import EtcdCredentials  # it imports torch: not at `--help`

        return EtcdCredentials(cacert=self.etcd_cacert, cert=self.etcd_cert, key=self.etcd_key,
                               user=self.etcd_user)

    @property
    def given(self) -> bool:
        """Any credential flag was given (they need `--rdzv-backend etcd`)."""
        return bool(self.etcd_cacert or self.etcd_cert or self.etcd_key or self.etcd_user)


@dataclass(frozen=True)
class Recovery:
    """Recovery: how faults are recovered from, and how many."""

    max_restarts: int = flag("--max-restarts", torchrun=True, parse=int, default=0,
                             help="faults the job may recover from, in place or by restart "
                                  "(default 0)")
    on_fault: str = flag(
        "--on-fault", choices=("shrink", "wait", "restart"), default="shrink",
        help="workers using run.train() recover in place: survivors go on without the failed "
             "worker until its replacement joins (shrink, default), or wait for the replacement "
             "(wait); restart: restart every worker from the checkpoint")
    spares: int = flag("--spares", parse=int, default=0, metavar="N",
                       help="hot spares per node: processes that run the script up to its "
                            "training loop, warm up on a private group, and take a failed "
                            "worker's rank")
    recovery_timeout: float = flag("--recovery-timeout", parse=seconds, default=30.0,
                                   help="seconds an in-place recovery may take before a full "
                                        "restart")
    join_timeout: float = 60.0
    """`--on-fault wait`: how long survivors wait for a replacement, then shrink (no flag)."""
    fork_server: bool = flag("--no-fork-server", kind=Kind.OFF_SWITCH, default=True,
                             renamed_from=("--no-warm-restarts",),
                             help="start every worker as a fresh interpreter (by default a "
                                  "fork server per node, which has imported torch and the "
                                  "workers' installed libraries, forks them in milliseconds; "
                                  "--no-warm-restarts is this flag's deprecated old name)")
    exact_reduction: bool = flag(
        "--exact-reduction", kind=Kind.SWITCH, default=False,
        help="a framework integration registers unbroken.exact_allreduce on the framework's "
             "DDP (gradients summed in rank order: bit-identical whatever the faults)")
    integrations: bool = flag("--no-integrations", kind=Kind.OFF_SWITCH, default=True,
                              help="do not recover a Hugging Face Trainer's steps in place "
                                   "(docs/integrations.md); its faults then restart every worker")
    quarantine_after: int = flag("--quarantine-after", parse=int, default=3, metavar="N",
                                 help="quarantine a node after N faults within "
                                      "--quarantine-window (0: never)")
    quarantine_window: float = flag("--quarantine-window", parse=seconds, default=3600.0,
                                    help="seconds over which a node's faults count towards "
                                         "quarantine")

    def __post_init__(self) -> None:
        for name, value in (("--max-restarts", self.max_restarts), ("--spares", self.spares),
                            ("--quarantine-after", self.quarantine_after)):
            if value < 0:
                raise UserError(f"{name} must be 0 or more, got {value}")
        if self.spares and self.on_fault == "restart":
            raise UserError("--spares takes failed workers' ranks in place; it does not work "
                            "with --on-fault restart")

    @property
    def quarantine(self) -> QuarantineRule:
        return QuarantineRule(after=self.quarantine_after, window=self.quarantine_window)


@dataclass(frozen=True)
class Hangs:
    """Hangs: when a worker that makes no progress is hung."""

    hang_timeout: float | None = flag(
        "--hang-timeout", parse=seconds,
        help="seconds without a step before a worker is hung (default: calibrated, 3 x the p99 "
             "step time, at least --hang-floor)")
    """None: calibrated from observed step times."""
    hang_floor: float = flag("--hang-floor", parse=seconds, default=1.0,
                             help="the least calibrated hang timeout, in seconds (default 1)")
    startup_timeout: float = flag("--startup-timeout", parse=seconds, default=600.0,
                                  help="seconds from a worker's first heartbeat to its first step")
    monitor_interval: float = flag("--monitor-interval", torchrun=True, parse=seconds,
                                   default=0.05, help="seconds between looks at the workers "
                                   "(default 0.05; torchrun's is 0.1)")


@dataclass(frozen=True)
class Health:
    """Health: what this node checks before it joins (`launch/health_check.py`)."""

    health_check: str = flag(
        "--health-check", choices=("off", "quick", "full"), default="quick",
        help="check this node before it joins: quick (the default, under 10 s: memory, an "
             "8 MiB write to --check-dir, the GPUs), full (also a 64 MiB write and a "
             "collective across the node's ranks) or off; a node that fails exits 4 "
             "(quarantined), saying what failed")
    check_dir: str | None = flag(
        "--check-dir", metavar="DIR",
        help="the checkpoint volume, to check writable at --check-min-write (default: none)")
    """None: no volume check."""
    check_min_write: float = flag(
        "--check-min-write", parse=positive_float, default=20.0, metavar="MB/S",
        help="the least write speed --check-dir must show (default 20 MB/s)")
    check_memory: int | None = flag(
        "--check-memory", parse=size_bytes, metavar="SIZE",
        help="the memory this node's processes need for their host copies, checked against "
             "the cgroup's limit and the host's free memory (default: not checked)")
    """None: no memory need known."""
    check_gpus: int = flag(
        "--check-gpus", parse=int, default=0, metavar="N",
        help="GPUs NVML must see and hear from (default 0: not checked)")


@dataclass(frozen=True)
class Telemetry:
    """Telemetry: metrics, status lines and events."""

    metrics_port: int | None = flag(
        "--metrics-port", parse=port, metavar="PORT",
        help="every agent serves Prometheus /metrics on this port: its node's counters "
             "(rank-seconds by goodput category, steps, faults, recoveries, checkpoint stall); "
             "the leader's also the job-wide series (see docs/goodput.md)")
    """None: no /metrics."""
    metrics_addr: str = flag("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                             help="the address /metrics binds to (default 127.0.0.1: loopback "
                                  "only; 0.0.0.0 lets a Prometheus on another host scrape it)")
    status_every: float = flag(
        "--status-every", parse=seconds_or_zero, default=30.0, metavar="SECONDS",
        help="the leader prints a status line (step, steps/s, goodput so far, faults, spares "
             "ready) this often; 0: never (default 30)")
    event_dir: str | None = flag(
        "--event-dir", metavar="DIR",
        help="also keep this node's events in DIR/node<K>-<pod uid or agent id>.jsonl: a "
             "directory on a volume every node shares, where they outlive a pod (`unbroken "
             "report DIR` merges every node's file, a deleted pod's included)")
    """None: the run dir's log only."""
    event_stdout: bool = flag(
        "--event-stdout", kind=Kind.SWITCH, default=False,
        help="also write this node's events to stdout, each line 'unbroken-event: {json}' "
             "(no shared volume: a pod's log keeps them; `unbroken report` reads a saved log)")
    event_log_handler: str = flag("--event-log-handler", torchrun=True, default="null",
                                  help="torchrun's event handler; unbroken writes its events to "
                                       "RUN_DIR/events.jsonl")


@dataclass(frozen=True)
class Logs:
    """Logs: where the workers' output goes (torchrun's layout)."""

    log_dir: str | None = flag("--log-dir", torchrun=True, help="base directory of the "
                               "workers' logs (torchrun's layout; default RUN_DIR/logs)")
    redirects: str = flag("--redirects", "-r", torchrun=True, default="0",
                          help="streams that go to log files only: 0 none, 1 stdout, 2 stderr, "
                               "3 both, or a per-local-rank map such as 0:1,1:2")
    tee: str = flag("-t", "--tee", default="0",
                    help="streams that go to log files and to the console, with a prefix "
                         "(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE); values as --redirects")
    log_line_prefix_template: str = flag(
        "--log-line-prefix-template", torchrun=True, default="",
        help="the prefix of each tee'd console line: ${role_name}, ${local_rank}, ${rank}, "
             "${hostname} (default: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else "
             "[<role><local_rank>]:)")
    local_ranks_filter: str = flag("--local-ranks-filter", torchrun=True, default="",
                                   help="show only these local ranks' output on the console, "
                                        "e.g. 0,1")
    duplicate_stdout_filters: list[str] = flag(
        "--duplicate-stdout-filters", torchrun=True, parse=comma_list, default=[],
        help="copy stdout lines containing one of these strings to filtered_stdout.log")
    duplicate_stderr_filters: list[str] = flag(
        "--duplicate-stderr-filters", torchrun=True, parse=comma_list, default=[],
        help="copy stderr lines containing one of these strings to filtered_stderr.log")
    logs_specs: str | None = flag("--logs-specs", torchrun=True, help="torchrun's LogsSpecs "
                                  "plugin; unbroken writes torchrun's layout itself")

    def __post_init__(self) -> None:
        self.spec("default", {})  # a malformed --redirects, --tee or filter fails here
        if self.log_dir and Path(self.log_dir).is_file():
            raise UserError(f"--log-dir {self.log_dir} is a file, not a directory")

    def spec(self, role: str, env: Mapping[str, str]) -> LogSpec:
        """The workers' `LogSpec`; the prefix template defaults to torchrun's variable in `env`."""
        return LogSpec(
            log_dir=self.log_dir, redirects=parse_std("--redirects", self.redirects),
            tee=parse_std("--tee", self.tee),
            local_ranks_filter=parse_ranks_filter(self.local_ranks_filter),
            prefix_template=self.log_line_prefix_template or env.get(PREFIX_TEMPLATE_VAR) or None,
            duplicate_stdout=tuple(self.duplicate_stdout_filters),
            duplicate_stderr=tuple(self.duplicate_stderr_filters), role=role)


@dataclass(frozen=True)
class Workers:
    """Workers: the script, how it is started, and how its processes are stopped."""

    nproc_per_node: int = flag("--nproc-per-node", torchrun=True, parse=nproc, default=1,
                               help="workers on this node (an integer, or auto/cpu/gpu/xpu)")
    start_method: str = flag("--start-method", torchrun=True, default="spawn",
                             choices=("spawn", "fork", "forkserver"),
                             help="accepted as torchrun's, and changes nothing: each worker "
                                  "runs its script as `python SCRIPT` would, forked by the "
                                  "node's fork server (a process that has imported torch and "
                                  "nothing of the script) unless --no-fork-server")
    role: str = flag("--role", default="default",
                     help="the workers' role (ROLE_NAME, log prefix)")
    module: bool = flag("-m", "--module", kind=Kind.SWITCH, default=False,
                        help="run SCRIPT as a module (python -m)")
    no_python: bool = flag("--no-python", torchrun=True, kind=Kind.SWITCH, default=False,
                           help="run SCRIPT as an executable, not through python")
    run_path: bool = flag("--run-path", torchrun=True, kind=Kind.SWITCH, default=False,
                          help="run SCRIPT with runpy.run_path (unbroken runs every script "
                               "that way)")
    numa_binding: str | None = flag("--numa-binding", torchrun=True,
                                    choices=("node", "socket", "exclusive", "core-complex"),
                                    help="not applied by unbroken (see the migration page)")
    signals_to_handle: str = flag("--signals-to-handle", torchrun=True,
                                  default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
                                  help="signals on which the agent stops the workers and exits "
                                       "128+signal")
    kill_grace: float = flag(
        "--shutdown-timeout", "--kill-grace", torchrun=True, parse=seconds, default=3.0,
        pet="PET_SHUTDOWN_TIMEOUT", metavar="SHUTDOWN_TIMEOUT",
        help="seconds between SIGTERM and SIGKILL when stopping workers, and for a node told "
             "to stop (SIGTERM) to hand its ranks to spares first (default 3)")
    virtual_local_rank: bool = flag(
        "--virtual-local-rank", torchrun=True, kind=Kind.SWITCH, default=False,
        help="LOCAL_RANK is 0 in every worker, and CUDA_VISIBLE_DEVICES names its own device")
    print_completion: str | None = flag(
        "--print-completion", torchrun=True, choices=COMPLETION_SHELLS,
        help="torchrun prints its shell completion script and exits; unbroken has none to "
             "print and refuses, saying so")
    fault: list[str] = flag("--fault", kind=Kind.APPEND, default=[], metavar="SPEC",
                            help="inject a fault, e.g. crash:rank=1,step=30 (kinds: "
                                 f"{', '.join(FAULT_KINDS)})")
    script: str = flag(kind=Kind.POSITIONAL, default="",
                       help="the training script (torchrun-style)")
    script_args: list[str] = flag(kind=Kind.REST, default=[], help="its arguments")

    def __post_init__(self) -> None:
        if self.print_completion:
            raise UserError(f"--print-completion {self.print_completion}: unbroken has no shell "
                            "completion script; torchrun prints its own and exits without "
                            "running SCRIPT (torchrun --print-completion needs shtab)")
        if self.no_python and self.module:
            raise UserError("--no-python cannot be used with -m/--module: a module runs "
                            "through python")
        parse_signals(self.signals_to_handle)
        parse_faults(self.faults)  # a bad spec fails here, not in every worker
        if not self.as_module and not self.as_executable:
            if not Path(self.script).is_file():
                raise UserError(f"script not found: {self.script}")
        elif self.as_executable and not shutil.which(self.script):
            raise UserError(f"executable not found: {self.script}")

    @property
    def as_module(self) -> bool:
        """`-m`, unless `--run-path` (which runs SCRIPT as a file, as torchrun's does)."""
        return self.module and not self.run_path

    @property
    def as_executable(self) -> bool:
        return self.no_python and not self.run_path

    @property
    def faults(self) -> str:
        """The `--fault` specs as the one string handed to workers (`unbroken.faults`)."""
        return ";".join(self.fault)


@dataclass(frozen=True)
class RunFlags:
    """`unbroken run`'s flags, by group (each validated on its own)."""

    workers: Workers
    rendezvous: Rendezvous
    recovery: Recovery
    hangs: Hangs
    etcd: Etcd
    health: Health
    telemetry: Telemetry
    logs: Logs


GROUPS = (Workers, Rendezvous, Recovery, Hangs, Etcd, Health, Telemetry, Logs)
"""`RunFlags`' groups, in its fields' order: the parser's and the validation's order."""
