"""The control store: a TCPStore held by the node-0 agent, never by a worker.

Keys live under `unbroken/<run id>/`, and every decision has one writer (the leader) or is
taken by compare-and-set, so agents never disagree. Each attempt's workers get a store of
their own on a fresh port, so no key or connection of a dead attempt can reach a new one.
"""

from __future__ import annotations

import errno
import json
import socket
from datetime import timedelta
from typing import Any

from torch.distributed import PrefixStore, Store, TCPStore

from unbroken.errors import ControlPlaneError


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0 picks a free one); a clear error if taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ControlPlaneError(f"cannot resolve master address {host!r}: {exc}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ControlPlaneError(
                f"port {port} on {host} is already in use; pass --master-port with a free port "
                "(or stop the other job)"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ControlPlaneError(
                f"{host} is not an address of this machine, so the node-0 agent cannot serve "
                "the store on it; pass this machine's address as --master-addr"
            ) from None
        raise ControlPlaneError(f"cannot bind {host}:{port}: {exc}") from None
    sock.listen(1024)
    return sock


def serve_store(host: str, port: int, timeout: float) -> tuple[TCPStore, int]:
    """Host a TCPStore on host:port, bound to that address only (loopback by default).

    Returns the store and its port. The store owns the listening socket: dropping the last
    reference to it closes the port.
    """
    sock = bind_listener(host, port)
    bound = sock.getsockname()[1]
    store = TCPStore(
        host, bound, None, True, timedelta(seconds=timeout),
        wait_for_workers=False, master_listen_fd=sock.fileno(),
    )
    sock.detach()  # the store closes the fd when it is destroyed; we must not close it too
    return store, bound


def connect_store(host: str, port: int, timeout: float) -> TCPStore:
    try:
        return TCPStore(host, port, None, False, timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:
        raise ControlPlaneError(
            f"cannot reach the node-0 agent's store at {host}:{port} within {timeout:g}s "
            f"({str(exc).splitlines()[0]}); is node 0 running with the same --master-addr/--master-port?"
        ) from None


class ControlStore:
    """Typed access to the keys of one run."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.raw = store
        self.prefix = f"unbroken/{run_id}/"
        self.kv = PrefixStore(self.prefix, store)

    def set_json(self, key: str, value: Any) -> None:
        self.kv.set(key, json.dumps(value))

    def get_json(self, key: str) -> Any | None:
        """The value of key, or None if unset; never blocks."""
        if not self.kv.check([key]):
            return None
        return json.loads(self.kv.get(key))

    def first_json(self, key: str, value: Any) -> Any:
        """Set key unless set already; return the value that won (compare-and-set)."""
        won = self.kv.compare_set(key, "", json.dumps(value))
        return json.loads(won)

    def add(self, key: str, amount: int) -> int:
        return int(self.kv.add(key, amount))

    def claim(self, key: str) -> bool:
        """True only for the first caller in the whole run."""
        return self.add(f"claim/{key}", 1) == 1
