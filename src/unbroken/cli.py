"""The `unbroken` command: run, demo, report."""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from unbroken.errors import ExitCode, UserError
from unbroken.exiting import exit_without_teardown
from unbroken.faults import FAULT_KINDS, parse_faults


class _Parser(argparse.ArgumentParser):
    """Bad input gets one line that says what is wrong and where to look, not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _positive_int(name: str):
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
    if text == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("--nproc-per-node gpu: no CUDA device is visible")
        return torch.cuda.device_count()
    return _positive_int("--nproc-per-node")(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value:g}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number, got {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535, got {value}")
    return value


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=_nproc, default=1,
                   help="workers on this node (an integer, or auto/cpu/gpu)")
    p.add_argument("--nnodes", default="1", help="number of nodes (N, or N:N)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's rank")
    p.add_argument("--master-addr", "--master_addr", default=None,
                   help="address of the node-0 agent (its store binds there); default 127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=_port, default=None,
                   help="port of the node-0 agent's control store (default 29500)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                   help="c10d: HOST:PORT, the same as --master-addr/--master-port; etcd: the "
                        "etcd cluster, HOST:PORT[,HOST:PORT...] (https://HOST:PORT for TLS)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d",
                   choices=["c10d", "static", "etcd", "etcd-v2"],
                   help="c10d/static: the node-0 agent holds the control store (node 0 is a "
                        "single point of failure); etcd/etcd-v2: the control plane is an etcd "
                        "v3 cluster and any agent can take over as leader")
    p.add_argument("--local-addr", "--local_addr", default=None,
                   help="this node's address, where it serves the workers' store when it leads "
                        "(default: --master-addr, or 127.0.0.1 with etcd)")
    p.add_argument("--leader-timeout", type=_seconds, default=2.0,
                   help="etcd: seconds of leader silence before another agent takes over")
    p.add_argument("--control-retry-window", type=_seconds, default=30.0,
                   help="seconds an agent retries a lost control plane before giving up")
    p.add_argument("--quarantine-after", type=int, default=3, metavar="N",
                   help="quarantine a node after N faults within --quarantine-window (0: never)")
    p.add_argument("--quarantine-window", type=_seconds, default=3600.0,
                   help="seconds over which a node's faults count towards quarantine")
    p.add_argument("--etcd-cacert", default=None, metavar="PATH",
                   help="CA that signed etcd's TLS certificate")
    p.add_argument("--etcd-cert", default=None, metavar="PATH",
                   help="client certificate, for etcd with --client-cert-auth")
    p.add_argument("--etcd-key", default=None, metavar="PATH", help="the client certificate's key")
    p.add_argument("--etcd-user", default=None,
                   help="etcd user; its password is read from UNBROKEN_ETCD_PASSWORD")
    p.add_argument("--rdzv-id", "--rdzv_id", "--run-id", "--run_id", dest="run_id", default=None,
                   help="job id, the same on every node (default: generated on one node)")
    p.add_argument("--standalone", action="store_true",
                   help="single node on a free loopback port (as torchrun --standalone)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="faults the job may recover from, in place or by restart (default 0)")
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
                        "give a --node-rank of --nnodes or more")
    p.add_argument("--recovery-timeout", type=_seconds, default=30.0,
                   help="seconds an in-place recovery may take before a full restart")
    p.add_argument("--run-dir", default=None,
                   help="where events, heartbeats and worker logs go (default unbroken_runs/RUN_ID)")
    p.add_argument("--redirect", action="store_true",
                   help="send each worker's output to RUN_DIR/node_K/attempt_A/rank_R.log")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help=f"inject a fault, e.g. crash:rank=1,step=30 (kinds: {', '.join(FAULT_KINDS)})")
    p.add_argument("--hang-timeout", type=_seconds, default=None,
                   help="seconds without a step before a worker is hung (default: calibrated)")
    p.add_argument("--startup-timeout", type=_seconds, default=600.0,
                   help="seconds from a worker's first heartbeat to its first step")
    p.add_argument("--node-timeout", type=_seconds, default=10.0,
                   help="seconds of agent silence before its node is lost")
    p.add_argument("--rdzv-timeout", type=_seconds, default=300.0,
                   help="seconds for all nodes to join an attempt")
    p.add_argument("--kill-grace", type=_seconds, default=3.0,
                   help="seconds between SIGTERM and SIGKILL when stopping workers")
    p.add_argument("--no-warm-restarts", dest="warm_restarts", action="store_false",
                   help="do not keep torch-imported standbys for restarts (see README)")
    p.add_argument("--secret-file", default=None, metavar="PATH",
                   help="the job's secret, in hex, that signs every control message (default: "
                        "UNBROKEN_SECRET, else RUN_DIR/secret, made by node 0 if absent)")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m)")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run SCRIPT as an executable, not through python")
    p.add_argument("script", help="the training script (torchrun-style)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def _defaults_from_pet(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """torchrun's `PET_<FLAG>` variables (as Kubeflow's PyTorchJob sets them) give a flag's
    default; a flag on the command line still wins."""
    for action in p._actions:
        name = "PET_RDZV_ID" if action.dest == "run_id" else f"PET_{action.dest.upper()}"
        if not action.option_strings or name not in env:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = env[name].strip().lower() in ("1", "true", "yes")
        elif isinstance(action, argparse._StoreFalseAction):
            action.default = env[name].strip().lower() not in ("1", "true", "yes")
        else:
            action.default = env[name]  # a string default goes through the flag's type
            action.required = False


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="unbroken", description="Fault-tolerant distributed training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="launch a training script (a drop-in for torchrun)")
    _add_run_flags(run)
    _defaults_from_pet(run, os.environ)
    demo = sub.add_parser("demo", help="train the example GPT with 4 workers through injected faults")
    demo.add_argument("--steps", type=_positive_int("--steps"), default=600)
    demo.add_argument("--workers", type=_positive_int("--workers"), default=4)
    demo.add_argument("--run-dir", default=None)
    demo.add_argument("--no-faults", action="store_true", help="run without injected faults")
    report = sub.add_parser("report", help="summarise a run from its event log")
    report.add_argument("run_dir")
    drain = sub.add_parser("drain", help="move a rank or a node of a running job onto spares")
    drain.add_argument("run_dir", nargs="?", default=None,
                       help="the job's run dir (or give --master-addr/--master-port/--rdzv-id)")
    which = drain.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int, default=None, help="the rank to move")
    which.add_argument("--node", type=int, default=None, help="the node whose every rank moves")
    drain.add_argument("--master-addr", default=None)
    drain.add_argument("--master-port", type=_port, default=None)
    drain.add_argument("--rdzv-id", dest="run_id", default=None)
    drain.add_argument("--secret-file", default=None, metavar="PATH",
                       help="the job's secret (default: UNBROKEN_SECRET, else RUN_DIR/secret)")
    drain.add_argument("--timeout", type=_seconds, default=120.0,
                       help="seconds to wait for the move (default 120)")
    return parser


def _nnodes(text: str) -> int:
    lo, _, hi = text.partition(":")
    try:
        n_lo, n_hi = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"--nnodes must be N or N:N, got {text!r}") from None
    if n_lo != n_hi:
        raise UserError(f"--nnodes {text}: elastic node ranges are not supported yet; give one number")
    if n_lo < 1:
        raise UserError(f"--nnodes must be at least 1, got {n_lo}")
    return n_lo


def config_from_args(args: argparse.Namespace):
    """Validate `unbroken run`'s flags into a LaunchConfig; a UserError names the bad one."""
    from unbroken.control.address import BackendKind, ControlAddress, EtcdCredentials
    from unbroken.launch.config import LaunchConfig
    from unbroken.launch.node_set import QuarantineRule

    nnodes = _nnodes(args.nnodes)
    if args.standby:
        if args.node_rank < nnodes:
            raise UserError(f"a --standby node takes a --node-rank of {nnodes} or more (ranks "
                            f"0-{nnodes - 1} are the job's nodes), got {args.node_rank}")
        if args.on_fault == "restart":
            raise UserError("--standby takes ranks over in place; it does not work with "
                            "--on-fault restart")
    elif not 0 <= args.node_rank < nnodes:
        raise UserError(f"--node-rank must be between 0 and {nnodes - 1} for --nnodes {nnodes}, got {args.node_rank}")
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
    addr, port = args.master_addr, args.master_port
    if args.rdzv_endpoint and not etcd:
        host, _, p = args.rdzv_endpoint.rpartition(":")
        if not host or not p.isdigit():
            raise UserError(f"--rdzv-endpoint must be HOST:PORT, got {args.rdzv_endpoint!r}")
        addr, port = addr or host, port if port is not None else _port(p)
    if args.standalone:
        if nnodes != 1:
            raise UserError("--standalone is for a single node; drop it or --nnodes")
        addr, port = addr or "127.0.0.1", port if port is not None else 0
    addr = addr or "127.0.0.1"
    port = 29500 if port is None else port
    if port == 0 and nnodes > 1:
        raise UserError("--master-port 0 (a free port) only works with one node; give a port")
    if not args.module and not args.no_python:
        if not Path(args.script).is_file():
            raise UserError(f"script not found: {args.script}")
    elif args.no_python and not shutil.which(args.script):
        raise UserError(f"executable not found: {args.script}")
    faults = ";".join(args.fault)
    parse_faults(faults)  # reject a bad spec here, not in every worker
    run_id = args.run_id or (
        f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}" if nnodes == 1 else "default"
    )
    if not all(c.isalnum() or c in "-_." for c in run_id):
        raise UserError(f"--rdzv-id may hold letters, digits, '-', '_' and '.', got {run_id!r}")
    return LaunchConfig(
        script=args.script, script_args=list(args.script_args), nproc_per_node=args.nproc_per_node,
        nnodes=nnodes, node_rank=args.node_rank, master_addr=addr, master_port=port,
        max_restarts=args.max_restarts, run_id=run_id,
        run_dir=Path(args.run_dir or Path("unbroken_runs") / run_id),
        module=args.module, no_python=args.no_python, redirect=args.redirect, faults=faults,
        hang_timeout=args.hang_timeout, startup_timeout=args.startup_timeout,
        node_timeout=args.node_timeout, rdzv_timeout=args.rdzv_timeout, kill_grace=args.kill_grace,
        warm_restarts=args.warm_restarts, on_fault=args.on_fault, spares=args.spares,
        recovery_timeout=args.recovery_timeout, standby=args.standby, secret_file=args.secret_file,
        backend=BackendKind.ETCD if etcd else BackendKind.TCP, etcd_endpoints=endpoints,
        etcd_credentials=EtcdCredentials(cacert=args.etcd_cacert, cert=args.etcd_cert,
                                         key=args.etcd_key, user=args.etcd_user),
        local_addr=args.local_addr, leader_timeout=args.leader_timeout,
        retry_window=args.control_retry_window,
        quarantine=QuarantineRule(after=args.quarantine_after, window=args.quarantine_window),
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from unbroken.launch.agent import Agent

    cfg = config_from_args(args)
    try:
        code = Agent(cfg).run()
    except UserError as exc:  # the control plane's errors included: one line, then out
        print(f"unbroken run: error: {exc}", file=sys.stderr, flush=True)
        code = exc.exit_code
    exit_without_teardown(int(code))  # the agent's store threads can abort a normal exit


def _cmd_demo(args: argparse.Namespace) -> int:
    from unbroken.demo import run_demo

    return run_demo(steps=args.steps, workers=args.workers, run_dir=args.run_dir,
                    faults=not args.no_faults)


def _cmd_report(args: argparse.Namespace) -> int:
    from unbroken.telemetry.summary import format_summary, summarize

    print(format_summary(summarize(args.run_dir)))
    return ExitCode.SUCCESS


def _cmd_drain(args: argparse.Namespace) -> int:
    from unbroken.launch.drain import drain

    moved = drain(args.run_dir, args.master_addr, args.master_port, args.run_id,
                  args.rank, args.node, args.timeout, args.secret_file)
    for move in moved.moves:
        print(f"moved rank {move['rank']} from worker {move['from']} to spare {move['to']}")
    print(f"generation {moved.gen} was up {moved.switch_s:.3f}s after the switch began")
    return ExitCode.SUCCESS


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    handlers = {"run": _cmd_run, "demo": _cmd_demo, "report": _cmd_report, "drain": _cmd_drain}
    try:
        return int(handlers[args.command](args))
    except UserError as exc:
        print(f"unbroken {args.command}: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    except OSError as exc:  # an unwritable run dir, an unreadable log, a full disk
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"unbroken {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED_SIGINT


if __name__ == "__main__":
    sys.exit(main())
