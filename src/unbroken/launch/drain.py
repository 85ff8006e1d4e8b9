"""`unbroken drain`: move a rank or a whole node of a running job onto ready spares.

The command is a client of the job's control store. It files a drain request and waits for
the leader's answer: the leader has a ready spare promoted into each drained slot, and once
the spare has registered (its warm-up and connection overlap with training), every member
switches at a step boundary to a generation that names the spare instead. The drained
worker exits cleanly; a drained node's agent leaves the job.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from unbroken.control.address import BackendKind, ControlAddress, EtcdCredentials, open_backend
from unbroken.control.backend import StoreUnavailable
from unbroken.control.channel import Channel
from unbroken.control.messages import DrainKind, DrainOutcome, DrainRequest
from unbroken.control.schema import CURRENT, RESULT, AttemptKeys
from unbroken.control.signing import Signer, load_secret
from unbroken.errors import ControlPlaneError, UserError

CONTROL_FILE = "control.json"  # in the run dir: where the leader's store is, and the run id


def find_store(run_dir: str | None, addr: str | None, port: int | None,
               run_id: str | None) -> tuple[ControlAddress, str]:
    """Where the job's control plane is, and its run id: from the control file that node 0
    wrote in the run dir (TCPStore or etcd, with etcd's certificate paths), or from flags
    (the TCPStore)."""
    if run_dir is not None:
        path = Path(run_dir) / CONTROL_FILE
        try:
            control = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path} not found: is {run_dir} the --run-dir of a running job? "
                            "(or give --master-addr, --master-port and --rdzv-id)") from None
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        address = ControlAddress.parse(control["control"],
                                       EtcdCredentials(**control.get("etcd", {})))
        if addr or port:
            address = ControlAddress.parse(f"tcp://{addr or address.tcp_host_port[0]}:"
                                           f"{port or address.tcp_host_port[1]}")
        return address, run_id or control["run_id"]
    if port is None or run_id is None:
        raise UserError("give the job's --run-dir, or its --master-port and --rdzv-id")
    return ControlAddress.parse(f"tcp://{addr or '127.0.0.1'}:{port}"), run_id


def request_drain(channel: Channel, request: DrainRequest, timeout: float) -> DrainOutcome:
    """File a drain request with the leader and wait for its outcome."""
    if channel.read(RESULT):
        raise UserError("the job has already ended")
    attempt = channel.read(CURRENT)
    keys = AttemptKeys(attempt) if attempt is not None else None
    if keys is None or channel.read(keys.plan) is None:
        raise UserError("the job has not started training yet; try again once it has")
    index = channel.append(keys.drains, request)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outcome = channel.read(keys.drain_outcome(index))
        if outcome is not None:
            return outcome
        if channel.read(CURRENT) != attempt or channel.read(RESULT):
            raise UserError("the job restarted or ended before the drain completed")
        time.sleep(0.05)
    raise UserError(f"the drain did not complete within {timeout:g}s; see the job's events "
                    "(drain_started, spare_promoted)")


def drain(run_dir: str | None, addr: str | None, port: int | None, run_id: str | None,
          rank: int | None, node: int | None, timeout: float,
          secret_file: str | None = None) -> DrainOutcome:
    if (rank is None) == (node is None):
        raise UserError("give exactly one of --rank R or --node K")
    if (rank if rank is not None else node) < 0:
        raise UserError("--rank and --node must be 0 or more")
    address, run_id = find_store(run_dir, addr, port, run_id)
    where = ",".join(address.endpoints)
    if address.kind == BackendKind.TCP:
        try:  # a fast, quiet answer when nothing listens (the store client retries, and logs)
            socket.create_connection(address.tcp_host_port, timeout=5.0).close()
        except OSError as exc:
            raise ControlPlaneError(f"cannot reach the job's control store at {where} "
                                    f"({exc.strerror or exc}); is the job running?") from None
    secret = load_secret(run_dir, secret_file)
    if secret is None:
        raise UserError("no job secret: give --secret-file, or set UNBROKEN_SECRET (node 0 wrote "
                        "it to RUN_DIR/secret on its host)")
    channel = Channel(open_backend(address, run_id, timeout=5.0), Signer(secret))
    request = (DrainRequest(DrainKind.RANK, rank) if rank is not None
               else DrainRequest(DrainKind.NODE, node))
    try:
        outcome = request_drain(channel, request, timeout)
    except StoreUnavailable as exc:
        raise ControlPlaneError(f"lost the job's control store at {where} (the job "
                                f"ended?): {exc}") from None
    if not outcome.ok:
        raise UserError(f"drain refused: {outcome.error}")
    return outcome
