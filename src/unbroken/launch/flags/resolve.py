"""The parsed flag groups, resolved into the `LaunchConfig`: the checks across groups, the
node rank, the control store's address, the run id, and a one-line warning for each
torchrun flag accepted with another effect than torchrun's. Pure, apart from the clock and
the random run id."""

from __future__ import annotations

import argparse
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from unbroken.control.address import BackendKind, ControlAddress
from unbroken.errors import UserError
from unbroken.launch.config import LaunchConfig
from unbroken.launch.flags.groups import ExtraNodes, Recovery, Rendezvous, RunFlags
from unbroken.launch.flags.values import LAST_CALL_DEFAULT, parse_rdzv_conf, parse_signals, port

Warn = Callable[[str], None]


def launch_config(run: RunFlags, warn: Warn, env: Mapping[str, str] = os.environ) -> LaunchConfig:
    """The `LaunchConfig` of valid groups; a `UserError` names a mistake across groups, and
    `warn(line)` is told of every flag accepted with another effect than torchrun's."""
    rdzv, workers = run.rendezvous, run.workers
    if run.etcd.given and not rdzv.etcd:
        raise UserError("--etcd-* flags need --rdzv-backend etcd")
    _warn_of_torchrun_only(run, warn)
    nodes = rdzv.node_range
    conf = parse_rdzv_conf(rdzv.rdzv_conf, warn)
    node_rank, assign = _node_rank(rdzv, run.recovery, warn)
    addr, the_port = _store_address(rdzv)
    endpoints = ControlAddress.parse(f"etcd://{rdzv.rdzv_endpoint}").endpoints if rdzv.etcd else ()
    run_id = _run_id(rdzv)
    return LaunchConfig(
        script=workers.script, script_args=list(workers.script_args),
        nproc_per_node=workers.nproc_per_node, nnodes=nodes.max, min_nodes=nodes.min,
        extra_nodes=ExtraNodes(rdzv.extra_nodes), assign_rank=assign,
        last_call=conf.last_call if conf.last_call is not None else LAST_CALL_DEFAULT,
        is_host=conf.is_host, node_rank=node_rank, master_addr=addr, master_port=the_port,
        run_id=run_id, run_dir=Path(rdzv.run_dir or Path("unbroken_runs") / run_id),
        module=workers.as_module, no_python=workers.as_executable,
        logs=run.logs.spec(workers.role, env), role=workers.role, faults=workers.faults,
        signals=parse_signals(workers.signals_to_handle),
        virtual_local_rank=workers.virtual_local_rank, kill_grace=workers.kill_grace,
        node_timeout=rdzv.node_timeout or conf.node_timeout or 10.0,
        rdzv_timeout=rdzv.rdzv_timeout or conf.join_timeout or 300.0,
        standby=rdzv.standby, secret_file=rdzv.secret_file, local_addr=rdzv.local_addr,
        retry_window=rdzv.retry_window,
        backend=BackendKind.ETCD if rdzv.etcd else BackendKind.TCP, etcd_endpoints=endpoints,
        recovery=run.recovery, hangs=run.hangs, etcd=run.etcd, health=run.health,
        telemetry=run.telemetry)


def _node_rank(rdzv: Rendezvous, recovery: Recovery, warn: Warn) -> tuple[int, bool]:
    """This node's rank, and whether it is assigned in join order instead (torchrun's c10d
    rendezvous: an elastic range, or several nodes and no --node-rank)."""
    nodes, given = rdzv.node_range, rdzv.node_rank
    assign = nodes.max > 1 and rdzv.rdzv_backend != "static" and (nodes.elastic or given is None)
    if nodes.elastic and given is not None:
        warn(f"--node-rank {given} is ignored with --nnodes {rdzv.nnodes}: as with "
             "torchrun's c10d rendezvous, node ranks are assigned in join order")
    node_rank = 0 if assign or given is None else given
    nnodes = nodes.max
    if rdzv.standby:
        if recovery.on_fault == "restart":
            raise UserError("--standby takes ranks over in place; it does not work with "
                            "--on-fault restart")
        if given is None:
            return node_rank, True  # a rank in join order, like the job's nodes (never node 0)
        if node_rank < nnodes:
            raise UserError(f"a --standby node takes a --node-rank of {nnodes} or more (ranks "
                            f"0-{nnodes - 1} are the job's nodes), got {given}")
        return node_rank, False
    if not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank must be between 0 and {nnodes - 1} for --nnodes {nnodes}, "
                        f"got {node_rank}")
    return node_rank, assign


def _store_address(rdzv: Rendezvous) -> tuple[str, int]:
    """The control store's HOST and PORT: --master-addr/--master-port, else a c10d
    --rdzv-endpoint (29400 when it names no port), else 127.0.0.1:29500; --standalone: a
    free port."""
    addr, the_port = rdzv.master_addr, rdzv.master_port
    endpoint = rdzv.rdzv_endpoint
    if endpoint and not rdzv.etcd:
        host, _, text = endpoint.rpartition(":")
        if not host:  # torchrun: an endpoint without a port takes the default port
            host, text = endpoint, "29400"
        if not text.isdigit():
            raise UserError(f"--rdzv-endpoint must be HOST:PORT, got {endpoint!r}")
        try:
            addr, the_port = addr or host, the_port if the_port is not None else port(text)
        except argparse.ArgumentTypeError as exc:
            raise UserError(f"--rdzv-endpoint {endpoint}: {exc}") from None
    if rdzv.standalone:
        addr, the_port = addr or "127.0.0.1", the_port if the_port is not None else 0
    the_port = 29500 if the_port is None else the_port
    if the_port == 0 and rdzv.node_range.max > 1:
        raise UserError("--master-port 0 (a free port) only works with one node; give a port")
    return addr or "127.0.0.1", the_port


def _run_id(rdzv: Rendezvous) -> str:
    """The given --rdzv-id; else a fresh one on one node, "default" on several (torchrun's)."""
    given = rdzv.run_id if rdzv.run_id not in (None, "none") else None
    if given:
        return given
    if rdzv.node_range.max == 1:
        return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    return "default"


def _warn_of_torchrun_only(run: RunFlags, warn: Warn) -> None:
    workers = run.workers
    if workers.run_path and (workers.module or workers.no_python):
        warn("--run-path runs SCRIPT as a Python file; -m and --no-python are ignored, as in "
             "torchrun")
    if run.telemetry.event_log_handler not in ("null", "console"):
        warn(f"--event-log-handler {run.telemetry.event_log_handler}: unbroken writes its "
             "events to RUN_DIR/events.jsonl and loads no handler plugins")
    if run.logs.logs_specs:
        warn(f"--logs-specs {run.logs.logs_specs}: unbroken loads no logging plugins; it writes "
             "torchrun's default log layout")
    if workers.numa_binding:
        warn(f"--numa-binding {workers.numa_binding} is not applied: unbroken does not bind "
             "workers to NUMA nodes (run them under numactl with --no-python to do so)")
