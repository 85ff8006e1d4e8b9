"""`unbroken run`'s flags: every flag of torchrun's parser (`torch.distributed.run`), in both
spellings and with torchrun's meaning, then unbroken's own; their `PET_*` variables; and
their validation into a `LaunchConfig`.

torchrun's flags come first and keep torchrun's names, defaults and meaning. Where one cannot
apply, it is accepted and `warnings` says in one line what unbroken does instead. unbroken's
own flags never take a torchrun flag's name (argparse also accepts unambiguous prefixes, so
`--redirect 3` is torchrun's `--redirects 3` here too). docs/torchrun-migration.md lists
each flag and what unbroken does with it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from unbroken.errors import UserError
from unbroken.faults import FAULT_KINDS, parse_faults

# torchrun's c10d rendezvous: wait this long after MIN nodes joined for more (up to MAX).
LAST_CALL_DEFAULT = 30.0


def positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
        return value
    return parse


def _nproc(text: str) -> int:
    if text == "auto":  # as torchrun: one per GPU if there are GPUs, else one per CPU
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"--nproc-per-node {text}: no CUDA device is visible")
        return torch.cuda.device_count()
    if text == "xpu":
        import torch

        if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
            raise argparse.ArgumentTypeError("--nproc-per-node xpu: no XPU device is visible")
        return torch.xpu.device_count()
    return positive_int("--nproc-per-node")(text)


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value:g}")
    return value


def seconds_or_zero(text: str) -> float:
    """Seconds, where 0 means "never"."""
    return 0.0 if text.strip() in ("0", "0.0") else seconds(text)


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number, got {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535, got {value}")
    return value


def _comma_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _spellings(name: str) -> list[str]:
    """torchrun's two spellings of a flag: --nproc-per-node and --nproc_per_node."""
    return [name] if "-" not in name[2:] else [name, "--" + name[2:].replace("-", "_")]


# torchrun's --print-completion shells (torch 2.15; shtab's, when shtab is installed).
COMPLETION_SHELLS = ("bash", "zsh", "tcsh")


def _add_torchrun_flags(p: argparse.ArgumentParser) -> None:
    """torchrun's parser, flag for flag (torch 2.13, and the two flags 2.15 added): the same
    names, values and defaults."""

    def add(name: str, *more: str, **kw) -> None:  # noqa: ANN003
        p.add_argument(*_spellings(name), *more, **kw)

    add("--nnodes", default="1", help="number of nodes: N, or MIN:MAX for an elastic job "
        "(torchrun's meaning by default; see --extra-nodes)")
    add("--nproc-per-node", type=_nproc, default=1,
        help="workers on this node (an integer, or auto/cpu/gpu/xpu)")
    add("--rdzv-backend", default="c10d", choices=["c10d", "static", "etcd", "etcd-v2"],
        help="c10d/static: one agent holds the control store (that host is a single point of "
             "failure); etcd/etcd-v2: the control plane is an etcd v3 cluster and any agent "
             "can take over as leader")
    add("--rdzv-endpoint", default=None,
        help="c10d: HOST:PORT, the same as --master-addr/--master-port; etcd: the etcd "
             "cluster, HOST:PORT[,HOST:PORT...] (https://HOST:PORT for TLS)")
    p.add_argument("--rdzv-id", "--rdzv_id", "--run-id", "--run_id", dest="run_id", default=None,
                   help="job id, the same on every node (default: generated on one node)")
    add("--rdzv-conf", default="", help="KEY=VALUE,...: join_timeout, last_call_timeout, "
        "keep_alive_interval, keep_alive_max_attempt, is_host (see the migration page)")
    p.add_argument("--standalone", action="store_true",
                   help="single node on a free loopback port (as torchrun --standalone)")
    add("--max-restarts", type=int, default=0,
        help="faults the job may recover from, in place or by restart (default 0)")
    add("--monitor-interval", type=seconds, default=None,
        help="seconds between looks at the workers (default 0.05; torchrun's is 0.1)")
    add("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"],
        help="as torchrun: a script is always started as a new process, whatever the method")
    add("--event-log-handler", default="null",
        help="torchrun's event handler; unbroken writes its events to RUN_DIR/events.jsonl")
    p.add_argument("--role", default="default", help="the workers' role (ROLE_NAME, log prefix)")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m)")
    add("--no-python", action="store_true", help="run SCRIPT as an executable, not through python")
    add("--run-path", action="store_true",
        help="run SCRIPT with runpy.run_path (unbroken runs every script that way)")
    add("--log-dir", default=None,
        help="base directory of the workers' logs (torchrun's layout; default RUN_DIR/logs)")
    add("--redirects", "-r", default="0",
        help="streams that go to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or a "
             "per-local-rank map such as 0:1,1:2")
    p.add_argument("-t", "--tee", default="0",
                   help="streams that go to log files and to the console, with a prefix "
                        "(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE); values as --redirects")
    add("--log-line-prefix-template", default="",
        help="the prefix of each tee'd console line: ${role_name}, ${local_rank}, ${rank}, "
             "${hostname} (default: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else "
             "[<role><local_rank>]:)")
    add("--local-ranks-filter", default="",
        help="show only these local ranks' output on the console, e.g. 0,1")
    add("--duplicate-stdout-filters", type=_comma_list, default=[],
        help="copy stdout lines containing one of these strings to filtered_stdout.log")
    add("--duplicate-stderr-filters", type=_comma_list, default=[],
        help="copy stderr lines containing one of these strings to filtered_stderr.log")
    add("--node-rank", type=int, default=None,
        help="this node's rank (default: 0 for one node; assigned in join order otherwise)")
    add("--master-addr", default=None,
        help="address of the agent that holds the control store; default 127.0.0.1")
    add("--master-port", type=port, default=None,
        help="port of that control store (default 29500)")
    add("--local-addr", default=None,
        help="this node's address, where it serves the workers' store when it leads "
             "(default: --master-addr, or 127.0.0.1 with etcd)")
    add("--logs-specs", default=None,
        help="torchrun's LogsSpecs plugin; unbroken writes torchrun's layout itself")
    add("--numa-binding", default=None, choices=["node", "socket", "exclusive", "core-complex"],
        help="not applied by unbroken (see the migration page)")
    add("--signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals on which the agent stops the workers and exits 128+signal")
    add("--shutdown-timeout", "--kill-grace", type=seconds, default=None,
        help="seconds between SIGTERM and SIGKILL when stopping workers, and for a node told "
             "to stop (SIGTERM) to hand its ranks to spares first (default 3)")
    add("--virtual-local-rank", action="store_true",
        help="LOCAL_RANK is 0 in every worker, and CUDA_VISIBLE_DEVICES names its own device")
    add("--print-completion", choices=COMPLETION_SHELLS, default=None,
        help="torchrun prints its shell completion script and exits; unbroken has none to "
             "print and refuses, saying so")


def _add_own_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extra-nodes", choices=("join", "standby"), default="join",
                   help="with --nnodes MIN:MAX: nodes beyond MIN join the job up to MAX "
                        "(join: torchrun's meaning), or stand by with spares that take a lost "
                        "node's ranks, so that the world stays MIN nodes (standby: NVRx "
                        "ft_launcher's meaning)")
    p.add_argument("--leader-timeout", type=seconds, default=2.0,
                   help="etcd: seconds of leader silence before another agent takes over")
    p.add_argument("--continue-dead-job", action="store_true",
                   help="etcd: if the control plane holds the keys of a dead job under this "
                        "--rdzv-id (no leader alive), clear them and start this job under it: "
                        "the training resumes from its checkpoints (default: refuse, saying so; "
                        "`unbroken k8s` passes it, its ids being unique to a JobSet)")
    p.add_argument("--control-retry-window", type=seconds, default=30.0,
                   help="seconds an agent retries a lost control plane before giving up")
    p.add_argument("--quarantine-after", type=int, default=3, metavar="N",
                   help="quarantine a node after N faults within --quarantine-window (0: never)")
    p.add_argument("--quarantine-window", type=seconds, default=3600.0,
                   help="seconds over which a node's faults count towards quarantine")
    p.add_argument("--etcd-cacert", default=None, metavar="PATH",
                   help="CA that signed etcd's TLS certificate")
    p.add_argument("--etcd-cert", default=None, metavar="PATH",
                   help="client certificate, for etcd with --client-cert-auth")
    p.add_argument("--etcd-key", default=None, metavar="PATH", help="the client certificate's key")
    p.add_argument("--etcd-user", default=None,
                   help="etcd user; its password is read from UNBROKEN_ETCD_PASSWORD")
    p.add_argument("--on-fault", choices=("shrink", "wait", "restart"), default="shrink",
                   help="workers using run.train() recover in place: survivors go on without the "
                        "failed worker until its replacement joins (shrink, default), or wait for "
                        "the replacement (wait); restart: restart every worker from the checkpoint")
    p.add_argument("--spares", type=int, default=0, metavar="N",
                   help="hot spares per node: processes that run the script up to its training "
                        "loop, warm up on a private group, and take a failed worker's rank")
    p.add_argument("--standby", action="store_true",
                   help="join a running multi-node job as a standby node: every process is a "
                        "spare, and they take over a lost node's or a drained node's ranks; "
                        "give a --node-rank of --nnodes or more, or none (it claims a standby id: 100, "
                        "101, ...)")
    p.add_argument("--recovery-timeout", type=seconds, default=30.0,
                   help="seconds an in-place recovery may take before a full restart")
    p.add_argument("--run-dir", default=None,
                   help="where events, heartbeats and worker logs go (default unbroken_runs/RUN_ID)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help=f"inject a fault, e.g. crash:rank=1,step=30 (kinds: {', '.join(FAULT_KINDS)})")
    p.add_argument("--hang-timeout", type=seconds, default=None,
                   help="seconds without a step before a worker is hung (default: calibrated, "
                        "3 x the p99 step time, at least --hang-floor)")
    p.add_argument("--hang-floor", type=seconds, default=1.0,
                   help="the least calibrated hang timeout, in seconds (default 1)")
    p.add_argument("--startup-timeout", type=seconds, default=600.0,
                   help="seconds from a worker's first heartbeat to its first step")
    p.add_argument("--node-timeout", type=seconds, default=None,
                   help="seconds of agent silence before its node is lost (default 10)")
    p.add_argument("--rdzv-timeout", type=seconds, default=None,
                   help="seconds for the nodes to join an attempt (default 300; torchrun's "
                        "--rdzv-conf join_timeout sets it too)")
    p.add_argument("--no-warm-restarts", dest="warm_restarts", action="store_false",
                   help="do not keep warm standbys (torch and the script's imports done) for "
                        "restarts (see README)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="the job's secret, in hex, that signs every control message, the same on "
                        "every node (default: UNBROKEN_SECRET; else a one-node job makes its own, "
                        "and a multi-node job runs unsigned and says so)")
    p.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                   help="the leader's agent serves Prometheus /metrics on this port (goodput, "
                        "badput by category, step and recovery times, faults; see "
                        "docs/goodput.md)")
    p.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                   help="the address /metrics binds to (default 127.0.0.1: loopback only; "
                        "0.0.0.0 lets a Prometheus on another host scrape it)")
    p.add_argument("--status-every", type=seconds_or_zero, default=30.0, metavar="SECONDS",
                   help="the leader prints a status line (step, steps/s, goodput so far, "
                        "faults, spares ready) this often; 0: never (default 30)")
    p.add_argument("script", help="the training script (torchrun-style)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def add_run_flags(p: argparse.ArgumentParser) -> None:
    _add_torchrun_flags(p)
    _add_own_flags(p)


def _truthy(text: str) -> bool:
    """torchrun reads a switch's PET_ variable as an integer (PET_NO_PYTHON=1); `true` too."""
    text = text.strip().lower()
    if text in ("true", "yes"):
        return True
    try:
        return bool(int(text or "0"))
    except ValueError:
        return False


def pet_name(dest: str) -> str:
    """A flag's torchrun variable: PET_<DEST>, with torchrun's dest (`rdzv_id`, not ours)."""
    return f"PET_{('rdzv_id' if dest == 'run_id' else dest).upper()}"


@dataclass(frozen=True)
class BadPet:
    """A `PET_` value outside its flag's choices, stood in for the flag's value."""

    message: str


def defaults_from_pet(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """torchrun's `PET_<FLAG>` variables (as Kubeflow's PyTorchJob and TrainJob set them)
    give every flag its default; a flag on the command line still wins."""
    for action in p._actions:
        name = pet_name(action.dest)
        if not action.option_strings or name not in env or isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = _truthy(env[name])
        elif isinstance(action, argparse._StoreFalseAction):
            action.default = not _truthy(env[name])
        elif isinstance(action, argparse._AppendAction):
            action.default = [env[name]]
        elif action.choices is not None and env[name] not in action.choices:
            # argparse takes a default unchecked: keep the mistake for config_from_args.
            action.default = BadPet(f"{action.option_strings[0]} must be one of "
                                    f"{', '.join(map(str, action.choices))}, got "
                                    f"{env[name]!r} (from {name})")
        else:
            action.default = env[name]  # a string default goes through the flag's type
            action.required = False


# ---------------------------------------------------------------- validation


@dataclass(frozen=True)
class NodeRange:
    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min != self.max


def parse_nnodes(text: str) -> NodeRange:
    lo, sep, hi = text.strip().partition(":")
    try:
        n_lo, n_hi = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UserError(f"--nnodes must be N or MIN:MAX with whole numbers, got {text!r}") from None
    if n_lo < 1:
        raise UserError(f"--nnodes {text}: the number of nodes must be at least 1")
    if n_hi < n_lo:
        raise UserError(f"--nnodes {text}: MIN must not exceed MAX")
    return NodeRange(n_lo, n_hi)


@dataclass
class RdzvConf:
    """torchrun's `--rdzv-conf`, mapped onto unbroken's settings."""

    join_timeout: float | None = None
    last_call: float | None = None
    node_timeout: float | None = None
    is_host: bool | None = None


_IGNORED_CONF = {
    "close_timeout": "unbroken's agents leave on the leader's result, not after a close wait",
    "read_timeout": "control-store reads are retried for --control-retry-window instead",
    "use_libuv": "the store's transport is chosen by torch",
    "store_type": "the workers' store is always a TCPStore served by the leading agent",
}


def parse_rdzv_conf(text: str, warn) -> RdzvConf:  # noqa: ANN001
    conf = RdzvConf()
    if not text.strip():
        return conf
    keepalive: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise UserError(f"--rdzv-conf takes KEY=VALUE,KEY=VALUE, got {text!r}")
        try:
            if key in ("join_timeout", "timeout"):
                conf.join_timeout = float(value)
            elif key == "last_call_timeout":
                conf.last_call = float(value)
            elif key in ("keep_alive_interval", "keep_alive_max_attempt"):
                keepalive[key] = float(value)
            elif key == "is_host":
                conf.is_host = value.lower() in ("1", "true", "yes")
            elif key in _IGNORED_CONF:
                warn(f"--rdzv-conf {key} has no effect: {_IGNORED_CONF[key]}")
            else:
                warn(f"--rdzv-conf {key} is not a rendezvous setting unbroken knows; ignored")
        except ValueError:
            raise UserError(f"--rdzv-conf {key} takes a number, got {value!r}") from None
    for key, seconds_ in (("join_timeout", conf.join_timeout), ("last_call_timeout", conf.last_call)):
        if seconds_ is not None and seconds_ < 0:
            raise UserError(f"--rdzv-conf {key} must be 0 or more seconds, got {seconds_:g}")
    if keepalive:  # torchrun: a node is dead after max_attempt missed keep-alives
        conf.node_timeout = (keepalive.get("keep_alive_interval", 5.0)
                             * keepalive.get("keep_alive_max_attempt", 3.0))
    return conf


def parse_signals(text: str) -> tuple[int, ...]:
    out = []
    for name in (x.strip() for x in text.split(",") if x.strip()):
        try:
            out.append(int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]))
        except KeyError:
            raise UserError(f"--signals-to-handle: unknown signal {name!r}") from None
    return tuple(out)


def config_from_args(args: argparse.Namespace, warn) -> object:  # noqa: ANN001, C901, PLR0912, PLR0915
    """Validate `unbroken run`'s flags into a LaunchConfig; a UserError names the bad one.
    `warn(line)` is told of every flag accepted with another effect than torchrun's."""
    from unbroken.control.address import BackendKind, ControlAddress, EtcdCredentials
    from unbroken.launch.config import ExtraNodes, LaunchConfig
    from unbroken.launch.node_set import QuarantineRule
    from unbroken.launch.worker_logs import (
        PREFIX_TEMPLATE_VAR,
        LogSpec,
        parse_ranks_filter,
        parse_std,
    )

    for value in vars(args).values():
        if isinstance(value, BadPet):
            raise UserError(value.message)
    if args.print_completion:
        raise UserError(f"--print-completion {args.print_completion}: unbroken has no shell "
                        "completion script; torchrun prints its own and exits without "
                        "running SCRIPT (torchrun --print-completion needs shtab)")
    nodes = parse_nnodes(args.nnodes)
    conf = parse_rdzv_conf(args.rdzv_conf, warn)
    extra = ExtraNodes(args.extra_nodes)
    if extra == ExtraNodes.STANDBY and not nodes.elastic:
        raise UserError("--extra-nodes standby needs --nnodes MIN:MAX (nodes beyond MIN stand by)")
    static = args.rdzv_backend == "static"
    if nodes.elastic and static:
        raise UserError(f"--nnodes {args.nnodes}: the static rendezvous takes a fixed number of "
                        "nodes; use --rdzv-backend c10d or etcd for a range")
    if nodes.elastic and args.standby:
        raise UserError("--standby is for a fixed --nnodes; with a range, nodes beyond MAX "
                        "(or beyond MIN with --extra-nodes standby) stand by on their own")
    assign = nodes.max > 1 and not static and (nodes.elastic or args.node_rank is None)
    if nodes.elastic and args.node_rank is not None:
        warn(f"--node-rank {args.node_rank} is ignored with --nnodes {args.nnodes}: as with "
             "torchrun's c10d rendezvous, node ranks are assigned in join order")
    node_rank = 0 if assign or args.node_rank is None else args.node_rank
    nnodes = nodes.max
    if args.standby:
        if args.on_fault == "restart":
            raise UserError("--standby takes ranks over in place; it does not work with "
                            "--on-fault restart")
        if args.node_rank is None:
            assign = True  # a rank in join order, like the job's nodes (never node 0)
        elif node_rank < nnodes:
            raise UserError(f"a --standby node takes a --node-rank of {nnodes} or more (ranks "
                            f"0-{nnodes - 1} are the job's nodes), got {args.node_rank}")
        else:
            assign = False
    elif not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank must be between 0 and {nnodes - 1} for --nnodes {nnodes}, "
                        f"got {node_rank}")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.spares < 0:
        raise UserError(f"--spares must be 0 or more, got {args.spares}")
    if args.spares and args.on_fault == "restart":
        raise UserError("--spares takes failed workers' ranks in place; it does not work with "
                        "--on-fault restart")
    if args.quarantine_after < 0:
        raise UserError(f"--quarantine-after must be 0 or more, got {args.quarantine_after}")
    etcd = args.rdzv_backend in ("etcd", "etcd-v2")
    endpoints: tuple[str, ...] = ()
    if etcd:
        if not args.rdzv_endpoint:
            raise UserError(f"--rdzv-backend {args.rdzv_backend} needs --rdzv-endpoint "
                            "HOST:PORT[,HOST:PORT...] naming the etcd cluster")
        endpoints = ControlAddress.parse(f"etcd://{args.rdzv_endpoint}").endpoints
        if args.standalone:
            raise UserError("--standalone serves its own store; drop it or --rdzv-backend etcd")
    if (args.etcd_cacert or args.etcd_cert or args.etcd_key or args.etcd_user) and not etcd:
        raise UserError("--etcd-* flags need --rdzv-backend etcd")
    for path in (args.etcd_cacert, args.etcd_cert, args.etcd_key):
        if path and not Path(path).is_file():
            raise UserError(f"file not found: {path}")
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise UserError("--etcd-cert and --etcd-key go together")
    addr, the_port = args.master_addr, args.master_port
    if args.rdzv_endpoint and not etcd:
        host, _, p = args.rdzv_endpoint.rpartition(":")
        if not host:  # torchrun: an endpoint without a port takes the default port
            host, p = args.rdzv_endpoint, "29400"
        if not p.isdigit():
            raise UserError(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")
        addr, the_port = addr or host, the_port if the_port is not None else port(p)
    if args.standalone:
        if nodes.max != 1:
            raise UserError("--standalone is for a single node; drop it or --nnodes")
        addr, the_port = addr or "127.0.0.1", the_port if the_port is not None else 0
    addr = addr or "127.0.0.1"
    the_port = 29500 if the_port is None else the_port
    if the_port == 0 and nodes.max > 1:
        raise UserError("--master-port 0 (a free port) only works with one node; give a port")
    if args.no_python and args.module:
        raise UserError("--no-python cannot be used with -m/--module: a module runs through python")
    if args.run_path and (args.module or args.no_python):
        warn("--run-path runs SCRIPT as a Python file; -m and --no-python are ignored, as in torchrun")
    module = args.module and not args.run_path
    no_python = args.no_python and not args.run_path
    if not module and not no_python:
        if not Path(args.script).is_file():
            raise UserError(f"script not found: {args.script}")
    elif no_python and not shutil.which(args.script):
        raise UserError(f"executable not found: {args.script}")
    faults = ";".join(args.fault)
    parse_faults(faults)  # reject a bad spec here, not in every worker
    run_id = args.run_id if args.run_id not in (None, "none") else None
    run_id = run_id or (
        f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}" if nodes.max == 1 else "default"
    )
    if not all(c.isalnum() or c in "-_." for c in run_id):
        raise UserError(f"--rdzv-id may hold letters, digits, '-', '_' and '.', got {run_id!r}")
    logs = LogSpec(
        log_dir=args.log_dir, redirects=parse_std("--redirects", args.redirects),
        tee=parse_std("--tee", args.tee),
        local_ranks_filter=parse_ranks_filter(args.local_ranks_filter),
        prefix_template=args.log_line_prefix_template or os.environ.get(PREFIX_TEMPLATE_VAR) or None,
        duplicate_stdout=tuple(args.duplicate_stdout_filters),
        duplicate_stderr=tuple(args.duplicate_stderr_filters), role=args.role)
    if args.log_dir and Path(args.log_dir).is_file():
        raise UserError(f"--log-dir {args.log_dir} is a file, not a directory")
    if args.event_log_handler not in ("null", "console"):
        warn(f"--event-log-handler {args.event_log_handler}: unbroken writes its events to "
             "RUN_DIR/events.jsonl and loads no handler plugins")
    if args.logs_specs:
        warn(f"--logs-specs {args.logs_specs}: unbroken loads no logging plugins; it writes "
             "torchrun's default log layout")
    if args.numa_binding:
        warn(f"--numa-binding {args.numa_binding} is not applied: unbroken does not bind "
             "workers to NUMA nodes (run them under numactl with --no-python to do so)")
    rdzv_timeout = args.rdzv_timeout or conf.join_timeout or 300.0
    node_timeout = args.node_timeout or conf.node_timeout or 10.0
    return LaunchConfig(
        script=args.script, script_args=list(args.script_args), nproc_per_node=args.nproc_per_node,
        nnodes=nnodes, min_nodes=nodes.min, extra_nodes=extra, assign_rank=assign,
        last_call=conf.last_call if conf.last_call is not None else LAST_CALL_DEFAULT,
        is_host=conf.is_host, node_rank=node_rank, master_addr=addr, master_port=the_port,
        max_restarts=args.max_restarts, run_id=run_id,
        run_dir=Path(args.run_dir or Path("unbroken_runs") / run_id),
        module=module, no_python=no_python, logs=logs, role=args.role, faults=faults,
        hang_timeout=args.hang_timeout, hang_floor=args.hang_floor,
        startup_timeout=args.startup_timeout,
        node_timeout=node_timeout, rdzv_timeout=rdzv_timeout,
        kill_grace=args.shutdown_timeout or 3.0,
        monitor_interval=args.monitor_interval or 0.05,
        signals=parse_signals(args.signals_to_handle),
        virtual_local_rank=args.virtual_local_rank,
        warm_restarts=args.warm_restarts, on_fault=args.on_fault, spares=args.spares,
        recovery_timeout=args.recovery_timeout, standby=args.standby, secret_file=args.secret_file,
        backend=BackendKind.ETCD if etcd else BackendKind.TCP, etcd_endpoints=endpoints,
        etcd_credentials=EtcdCredentials(cacert=args.etcd_cacert, cert=args.etcd_cert,
                                         key=args.etcd_key, user=args.etcd_user),
        local_addr=args.local_addr, leader_timeout=args.leader_timeout,
        continue_dead_job=args.continue_dead_job,
        retry_window=args.control_retry_window,
        quarantine=QuarantineRule(after=args.quarantine_after, window=args.quarantine_window),
        metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
        status_every=args.status_every,
    )
