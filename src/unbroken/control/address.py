"""Where the control plane is, and how to reach it: one value that the agent, its workers
and `unbroken drain` all open the same way.

Two kinds: the embedded TCPStore held by the node-0 agent (`tcp://HOST:PORT`, the default:
it needs nothing installed, and node 0 is a single point of failure), or an etcd v3 cluster
(`etcd://HOST:PORT[,HOST:PORT...]`), which outlives any one host. The text form travels to
workers in their environment (`WorkerEnv.control`); credentials travel apart from it
(`EtcdCredentials`): file paths, and the password only in `UNBROKEN_ETCD_PASSWORD`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from enum import StrEnum

from unbroken.control.backend import Backend, StoreUnavailable
from unbroken.control.schema import CURRENT
from unbroken.errors import UserError

PASSWORD_VAR = "UNBROKEN_ETCD_PASSWORD"


class BackendKind(StrEnum):
    TCP = "tcp"  # the TCPStore served by the node-0 agent
    ETCD = "etcd"  # an etcd v3 cluster


@dataclass(frozen=True)
class EtcdCredentials:
    """How to authenticate to etcd; every field optional."""

    cacert: str | None = None
    """CA bundle that signed etcd's certificate (https endpoints)."""
    cert: str | None = None
    """Client certificate, for etcd started with --client-cert-auth."""
    key: str | None = None
    """The client certificate's key."""
    user: str | None = None
    """An etcd user; its password is read from UNBROKEN_ETCD_PASSWORD."""

    def to_environ(self) -> dict[str, str]:
        env = {"UNBROKEN_ETCD_CACERT": self.cacert, "UNBROKEN_ETCD_CERT": self.cert,
               "UNBROKEN_ETCD_KEY": self.key, "UNBROKEN_ETCD_USER": self.user}
        return {k: v for k, v in env.items() if v is not None}

    @classmethod
    def from_environ(cls, env: dict[str, str] | os._Environ) -> EtcdCredentials:
        return cls(cacert=env.get("UNBROKEN_ETCD_CACERT"), cert=env.get("UNBROKEN_ETCD_CERT"),
                   key=env.get("UNBROKEN_ETCD_KEY"), user=env.get("UNBROKEN_ETCD_USER"))


@dataclass(frozen=True)
class ControlAddress:
    kind: BackendKind
    endpoints: tuple[str, ...]
    """HOST:PORT each (etcd: several members; an https:// prefix asks for TLS)."""
    credentials: EtcdCredentials = field(default_factory=EtcdCredentials)

    def text(self) -> str:
        return f"{self.kind.value}://{','.join(self.endpoints)}"

    @classmethod
    def parse(cls, text: str, credentials: EtcdCredentials | None = None) -> ControlAddress:
        scheme, sep, rest = text.partition("://")
        if not sep or scheme not in BackendKind.__members__.values():
            raise UserError(f"not a control address: {text!r} (tcp://HOST:PORT or "
                            "etcd://HOST:PORT[,HOST:PORT...])")
        endpoints = tuple(e.strip() for e in rest.split(",") if e.strip())
        for e in endpoints:
            host, _, port = e.removeprefix("https://").removeprefix("http://").rpartition(":")
            if not host or not port.isdigit():
                raise UserError(f"an endpoint is HOST:PORT, got {e!r}")
        if not endpoints:
            raise UserError(f"no endpoint in {text!r}")
        return cls(BackendKind(scheme), endpoints, credentials or EtcdCredentials())

    @property
    def hosts(self) -> list[str]:
        """The host part of each endpoint (a name or an address), in order, once each."""
        names = (e.removeprefix("https://").removeprefix("http://").rpartition(":")[0]
                 for e in self.endpoints)
        return list(dict.fromkeys(n.strip("[]") for n in names))

    @property
    def tcp_host_port(self) -> tuple[str, int]:
        host, _, port = self.endpoints[0].rpartition(":")
        return host, int(port)


def unresolved(hosts: list[str]) -> list[str]:
    """The names among `hosts` that do not resolve now (a pod whose DNS record is not yet
    published, or a typo: the caller retries until its deadline, then says which)."""
    missing = []
    for host in hosts:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            missing.append(host)
    return missing


def address_toward(endpoint: str) -> str | None:
    """This host's address on the route to `endpoint` (HOST:PORT): what the other hosts of a
    job reach it at when they reach that endpoint too; None when there is no route. No
    packet is sent (a UDP connect only picks the route)."""
    host, _, port = endpoint.removeprefix("https://").removeprefix("http://").rpartition(":")
    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                           socket.SOCK_DGRAM) as probe:
            probe.connect((host, int(port)))
            return probe.getsockname()[0]
    except (OSError, ValueError):
        return None


def open_backend(address: ControlAddress, run_id: str, timeout: float = 5.0) -> Backend:
    """A client of the control plane at `address`, scoped to `run_id`.

    Raises `StoreUnavailable` (one line: where, and what to check) if it cannot be reached.
    """
    if address.kind == BackendKind.TCP:
        from unbroken.control.tcp import TcpBackend

        host, port = address.tcp_host_port
        return TcpBackend.connect(host, port, run_id, timeout)
    from unbroken.control.etcd import EtcdBackend

    c = address.credentials
    backend = EtcdBackend(list(address.endpoints), run_id, timeout, cacert=c.cacert, cert=c.cert,
                          key=c.key, user=c.user, password=os.environ.get(PASSWORD_VAR))
    backend.get(CURRENT.key)  # reachable, the TLS and the user are right: or one clear line now
    return backend


__all__ = ["BackendKind", "ControlAddress", "EtcdCredentials", "StoreUnavailable",
           "address_toward", "open_backend", "unresolved"]
