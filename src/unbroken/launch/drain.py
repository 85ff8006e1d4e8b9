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
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.control.address import BackendKind, ControlAddress, EtcdCredentials, open_backend
from unbroken.control.auth import job_auth, mismatch
from unbroken.control.backend import StoreUnavailable
from unbroken.control.channel import Channel
from unbroken.control.messages import DrainKind, DrainOutcome, DrainRequest, JobAuth
from unbroken.control.schema import CURRENT, JOB_AUTH, RESULT, AttemptKeys
from unbroken.control.signing import Signer, load_secret
from unbroken.errors import ConfigError, ControlPlaneError, UserError
from unbroken.polling import poll_until

CONTROL_FILE = "control.json"  # in each agent's run dir: where the control plane is, and the run id


@dataclass(frozen=True)
class DrainTarget:
    """Where `unbroken drain` finds the job: a run dir on this host (its agent's control
    file), or the control plane's own address from flags, which works from any host and,
    with etcd, after any failover."""

    run_dir: str | None = None
    backend: str | None = None
    """`--rdzv-backend`: c10d/static (the node-0 agent's TCPStore) or etcd/etcd-v2."""
    endpoint: str | None = None
    """`--rdzv-endpoint`: HOST:PORT of the TCPStore, or the etcd cluster's HOST:PORT,..."""
    master_addr: str | None = None
    master_port: int | None = None
    run_id: str | None = None
    credentials: EtcdCredentials = field(default_factory=EtcdCredentials)


def _from_flags(target: DrainTarget) -> ControlAddress | None:
    """The control plane's address as the flags name it; None when they name none."""
    etcd = target.backend in ("etcd", "etcd-v2")
    if etcd:
        if not target.endpoint:
            raise UserError(f"--rdzv-backend {target.backend} needs --rdzv-endpoint "
                            "HOST:PORT[,HOST:PORT...] naming the job's etcd cluster")
        return ControlAddress.parse(f"etcd://{target.endpoint}", target.credentials)
    if target.credentials != EtcdCredentials():
        raise UserError("--etcd-* flags need --rdzv-backend etcd")
    if target.endpoint:
        host, _, port = target.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise UserError(f"--rdzv-endpoint must be HOST:PORT, got {target.endpoint!r}")
        return ControlAddress.parse(f"tcp://{target.endpoint}")
    if target.master_addr or target.master_port:
        return ControlAddress.parse(f"tcp://{target.master_addr or '127.0.0.1'}:"
                                    f"{target.master_port or 29500}")
    return None


def find_store(target: DrainTarget) -> tuple[ControlAddress, str]:
    """Where the job's control plane is, and its run id: from the flags, else from the
    control file that this host's agent wrote in its run dir (any node's agent writes one)."""
    address, run_id = _from_flags(target), target.run_id
    if target.run_dir is not None and (address is None or run_id is None):
        path = Path(target.run_dir) / CONTROL_FILE
        try:
            control = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path} not found: is {target.run_dir} the --run-dir of a job's "
                            "agent on this host? (or give --rdzv-endpoint and --rdzv-id)") from None
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        if address is None:
            address = ControlAddress.parse(control["control"],
                                           EtcdCredentials(**control.get("etcd", {})))
        run_id = run_id or control["run_id"]
    if address is None or run_id is None:
        raise UserError("give the job's --rdzv-endpoint (or --master-addr/--master-port) and "
                        "--rdzv-id, or the --run-dir of its agent on this host")
    return address, run_id


def signer_for(job: JobAuth | None, secret: bytes | None) -> Signer | None:
    """How `unbroken drain` signs its request: as the job does (`control.auth`). Pure."""
    if job is not None and not job.signed:
        return None
    if secret is None:
        raise UserError("the job signs its control messages: give its secret with "
                        "--secret-file or UNBROKEN_SECRET")
    if job is not None and (why := mismatch(job, job_auth(secret))) is not None:
        raise ConfigError(why.replace("this agent", "this command"))
    return Signer(secret)


def request_drain(channel: Channel, request: DrainRequest, timeout: float) -> DrainOutcome:
    """File a drain request with the leader and wait for its outcome."""
    if channel.read(RESULT):
        raise UserError("the job has already ended")
    attempt = channel.read(CURRENT)
    keys = AttemptKeys(attempt) if attempt is not None else None
    if keys is None or channel.read(keys.plan) is None:
        raise UserError("the job has not started training yet; try again once it has")
    index = channel.position(keys.drains, channel.append(keys.drains, request))

    def outcome() -> DrainOutcome | None:
        done = channel.read(keys.drain_outcome(index))
        if done is None and (channel.read(CURRENT) != attempt or channel.read(RESULT)):
            raise UserError("the job restarted or ended before the drain completed")
        return done

    return poll_until(outcome, timeout, 0.05, timeout_error=lambda: UserError(
        f"the drain did not complete within {timeout:g}s; see the job's events "
        "(drain_started, spare_promoted)"))


def drain(target: DrainTarget, rank: int | None, node: int | None, timeout: float,
          secret_file: str | None = None) -> DrainOutcome:
    if (rank is None) == (node is None):
        raise UserError("give exactly one of --rank R or --node K")
    if (rank if rank is not None else node) < 0:
        raise UserError("--rank and --node must be 0 or more")
    address, run_id = find_store(target)
    where = ",".join(address.endpoints)
    if address.kind == BackendKind.TCP:
        try:  # a fast, quiet answer when nothing listens (the store client retries, and logs)
            socket.create_connection(address.tcp_host_port, timeout=5.0).close()
        except OSError as exc:
            raise ControlPlaneError(f"cannot reach the job's control store at {where} "
                                    f"({exc.strerror or exc}); is the job running?") from None
    backend = open_backend(address, run_id, timeout=5.0)
    job = Channel(backend).read(JOB_AUTH)
    signer = signer_for(job, load_secret(target.run_dir, secret_file))
    channel = Channel(backend, signer)
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
