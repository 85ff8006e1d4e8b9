"""The `unbroken` command: run, demo, report, drain, k8s, simulate."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from unbroken.errors import ExitCode, UserError
from unbroken.exiting import exit_without_teardown
from unbroken.k8s.flags import add_k8s_flags
from unbroken.launch.flags.parser import add_run_flags, config_from_args
from unbroken.launch.flags.values import port, positive_int, seconds
from unbroken.simulate.cli import add_simulate_flags, run_simulate


class _Help(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help already says it or there is
    none to say (no value, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default in (None, False, argparse.SUPPRESS)
                or default in ("", []) or "default" in text or "%(default)" in text):
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class _Parser(argparse.ArgumentParser):
    """Bad input gets one line that says what is wrong and where to look, not a usage dump."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _version() -> str:
    """`unbroken X (torch Y)`, from the installed distributions' metadata: no import of
    torch, so that it answers at once."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"unbroken {of('unbroken')} (torch {of('torch')})"


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="unbroken", description="Fault-tolerant distributed training for PyTorch.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="launch a training script (a drop-in for torchrun)")
    add_run_flags(run, os.environ)  # PET_* give the defaults, as torchrun's parser reads them
    demo = sub.add_parser("demo", help="train the example GPT with 4 workers through injected faults")
    demo.add_argument("--steps", type=positive_int("--steps"), default=600,
                      help="steps to train (default 600)")
    demo.add_argument("--workers", type=positive_int("--workers"), default=4,
                      help="worker processes (default 4)")
    demo.add_argument("--run-dir", default=None,
                      help="where its events go (default unbroken_runs/RUN_ID)")
    demo.add_argument("--no-faults", action="store_true", help="run without injected faults")
    report = sub.add_parser("report", help="summarise a run from its event log: goodput, "
                                           "faults, steps (text, JSON, CSV/Parquet, HTML)")
    report.add_argument("run_dir", nargs="+",
                        help="the run dir; one per node if the nodes do not share one")
    report.add_argument("--json", action="store_true",
                        help="print the whole report as one JSON object (docs/goodput.md)")
    report.add_argument("--csv", metavar="DIR", default=None,
                        help="write the tables (steps, faults, recoveries, checkpoints, goodput, "
                             "timeline) as CSV into DIR, and as Parquet if pyarrow is installed")
    report.add_argument("--html", metavar="FILE", default=None,
                        help="write one self-contained HTML page with plots (needs matplotlib)")
    drain = sub.add_parser("drain", help="move a rank or a node of a running job onto spares")
    drain.add_argument("run_dir", nargs="?", default=None,
                       help="the run dir of the job's agent on this host (or name the control "
                            "plane with --rdzv-endpoint and --rdzv-id, from any host)")
    which = drain.add_mutually_exclusive_group(required=True)
    which.add_argument("--rank", type=int, default=None, help="the rank to move")
    which.add_argument("--node", type=int, default=None, help="the node whose every rank moves")
    drain.add_argument("--rdzv-backend", "--rdzv_backend", default=None,
                       choices=["c10d", "static", "etcd", "etcd-v2"],
                       help="the job's control plane, as given to `unbroken run` (default c10d)")
    drain.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                       help="c10d: the node-0 agent's HOST:PORT; etcd: the cluster's "
                            "HOST:PORT[,HOST:PORT...] (reaches the job after any failover)")
    drain.add_argument("--master-addr", "--master_addr", default=None,
                       help="the job's control store, as `unbroken run` was given it")
    drain.add_argument("--master-port", "--master_port", type=port, default=None,
                       help="its port")
    drain.add_argument("--rdzv-id", "--rdzv_id", dest="run_id", default=None,
                       help="the job's id, as `unbroken run` was given it")
    for flag, text in (("--etcd-cacert", "CA that signed etcd's certificate"),
                       ("--etcd-cert", "client certificate"), ("--etcd-key", "its key"),
                       ("--etcd-user", "etcd user (password in UNBROKEN_ETCD_PASSWORD)")):
        drain.add_argument(flag, default=None, help=text)
    drain.add_argument("--secret-file", default=None, metavar="PATH",
                       help="the job's secret, if it signs (default: UNBROKEN_SECRET, else the "
                            "run dir's secret of a one-node job)")
    drain.add_argument("--timeout", type=seconds, default=120.0,
                       help="seconds to wait for the move (default 120)")
    k8s = sub.add_parser("k8s", help="write the Kubernetes manifests of a job: a JobSet (or a "
                                     "TrainJob, a PyTorchJob), with etcd and metrics if asked")
    add_k8s_flags(k8s)
    simulate = sub.add_parser("simulate", help="what recovery is worth at N GPUs, and how many "
                                               "spares to buy: a Monte Carlo of one job")
    add_simulate_flags(simulate)
    return parser


def _warn(line: str) -> None:
    print(f"unbroken run: warning: {line}", file=sys.stderr, flush=True)


def _cmd_run(args: argparse.Namespace) -> int:
    from unbroken.launch.agent import Agent

    cfg = config_from_args(args, _warn)
    try:
        code = Agent(cfg).run(restore_signals=False)  # exits right after: see Agent.run
    except UserError as exc:  # the control plane's errors included: one line, then out
        print(f"unbroken run: error: {exc}", file=sys.stderr, flush=True)
        code = exc.exit_code
    exit_without_teardown(int(code))  # the agent's store threads can abort a normal exit


def _cmd_demo(args: argparse.Namespace) -> int:
    from unbroken.demo import run_demo

    return run_demo(steps=args.steps, workers=args.workers, run_dir=args.run_dir,
                    faults=not args.no_faults)


def _cmd_report(args: argparse.Namespace) -> int:
    import json

    from unbroken.telemetry.report import build_report, format_goodput, write_tables
    from unbroken.telemetry.summary import format_summary, summarize

    report = build_report(args.run_dir)
    if args.csv:
        for path in write_tables(report, args.csv):
            print(f"wrote {path}", file=sys.stderr)
    if args.html:
        from unbroken.telemetry.html_report import write_html

        print(f"wrote {write_html(report, args.html)}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, separators=(",", ":")))
    else:
        summary = summarize(args.run_dir)
        for f, row in zip(summary["faults"], report["faults"], strict=True):
            f["cost"] = sum((row.get("cost_s") or {}).values())
        print(format_summary(summary))
        print(format_goodput(report))
        if report.get("anomalies") is not None:
            from unbroken.telemetry.anomaly_report import format_anomalies

            print(format_anomalies(report["anomalies"]))
    return ExitCode.SUCCESS


def _cmd_drain(args: argparse.Namespace) -> int:
    from unbroken.control.address import EtcdCredentials
    from unbroken.launch.drain import DrainTarget, drain

    target = DrainTarget(
        run_dir=args.run_dir, backend=args.rdzv_backend, endpoint=args.rdzv_endpoint,
        master_addr=args.master_addr, master_port=args.master_port, run_id=args.run_id,
        credentials=EtcdCredentials(cacert=args.etcd_cacert, cert=args.etcd_cert,
                                    key=args.etcd_key, user=args.etcd_user))
    moved = drain(target, args.rank, args.node, args.timeout, args.secret_file)
    for move in moved.moves:
        print(f"moved rank {move['rank']} from worker {move['from']} to spare {move['to']}")
    print(f"generation {moved.gen} was up {moved.switch_s:.3f}s after the switch began")
    return ExitCode.SUCCESS


def _cmd_k8s(args: argparse.Namespace) -> int:
    from unbroken.k8s.flags import spec_from_args
    from unbroken.k8s.pod import secret_command
    from unbroken.k8s.render import render, to_yaml, write_dir

    spec = spec_from_args(args)
    for line in spec.warnings():
        print(f"unbroken k8s: warning: {line}", file=sys.stderr)
    objs = render(spec)
    if args.output:
        for path in write_dir(objs, args.output):
            print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(to_yaml(objs))
    print("unbroken k8s: make the job's secret once, before applying (its value is never "
          f"shown or rendered):\n{secret_command(spec)}", file=sys.stderr)
    return ExitCode.SUCCESS


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the sub-command's own parser: its name, its --help
        sub = next(a for a in parser._actions if a.dest == "command")
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    handlers = {"run": _cmd_run, "demo": _cmd_demo, "report": _cmd_report, "drain": _cmd_drain,
                "k8s": _cmd_k8s, "simulate": run_simulate}
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
