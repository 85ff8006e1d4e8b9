"""The embedded backend: a TCPStore served by the node-0 agent (the leader), never by a worker.

It needs nothing installed, and node 0 is its single point of failure: when the leader's
host dies, the job ends (exit 3). Each attempt's workers also get a store of their own on a
fresh port (`serve_store(port=0)`), so no key or connection of a dead attempt reaches a new one.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from torch.distributed import PrefixStore, Store, TCPStore

from unbroken.control.backend import StoreUnavailable
from unbroken.errors import ConfigError, ControlPlaneError

T = TypeVar("T")
_STORE_ERRORS = (RuntimeError, OSError)
_FEW = 4  # get_many: up to this many keys are read one by one  # what a TCPStore call raises when the server is gone


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
            raise ConfigError(
                f"{host} is not an address of this machine, so the node-0 agent cannot serve "
                "the store on it; pass this machine's address as --master-addr"
            ) from None
        raise ControlPlaneError(f"cannot bind {host}:{port}: {exc}") from None
    try:
        sock.listen(1024)
    except OSError as exc:  # two binds with SO_REUSEADDR: the second listen() loses
        sock.close()
        raise ControlPlaneError(
            f"port {port} on {host} is already in use; pass --master-port with a free port "
            f"(or stop the other job) ({exc.strerror})") from None
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
    except _STORE_ERRORS as exc:
        raise StoreUnavailable(
            f"cannot reach the node-0 agent's store at {host}:{port} within {timeout:g}s "
            f"({str(exc).splitlines()[0]}); is node 0 running with the same --master-addr/--master-port?"
        ) from None


class TcpBackend:
    """`backend.Backend` over a TCPStore; `run_id` scopes every key to one run."""

    def __init__(self, store: Store, run_id: str, addr: str = "", port: int = 0) -> None:
        self.run_prefix = f"unbroken/{run_id}/"
        self._kv = PrefixStore(self.run_prefix, store)
        self.addr, self.port = addr, port
        self._store = store  # keeps a served store alive as long as the backend

    @classmethod
    def connect(cls, addr: str, port: int, run_id: str, timeout: float) -> TcpBackend:
        return cls(connect_store(addr, port, timeout), run_id, addr, port)

    def describe(self) -> str:
        return f"the control store at {self.addr}:{self.port}"

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        try:
            return fn(*args)
        except _STORE_ERRORS as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StoreUnavailable(f"lost {self.describe()} (node-0 agent gone?): {text}") from None

    def get(self, key: str) -> str | None:
        if not self._call(self._kv.check, [key]):
            return None
        return self._call(self._kv.get, key).decode()

    def get_many(self, keys: list[str]) -> list[str | None]:
        """Two round trips when every key is set (the leases, a queue's counted entries);
        else one check and one get per key (`multi_get` would block on a missing key). A
        read of a few keys (an agent's look: slots mostly not set yet) skips the first
        check, which would rarely pay."""
        if len(keys) > _FEW and self._call(self._kv.check, keys):
            return [v.decode() for v in self._call(self._kv.multi_get, keys)]
        return [self.get(k) for k in keys]

    def set(self, key: str, value: str) -> None:
        self._call(self._kv.set, key, value)

    def delete_prefix(self) -> None:
        """Nothing to do: the store lives and dies with the job's node-0 agent."""

    def compare_set(self, key: str, expected: str | None, desired: str) -> str:
        return self._call(self._kv.compare_set, key, expected or "", desired).decode()

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self._kv.add, key, amount))

    def increment(self, key: str) -> None:
        self.add(key, 1)

    def wait(self, keys: list[str], timeout: float) -> bool:
        try:
            self._kv.wait(keys, timedelta(seconds=timeout))
            return True
        except _STORE_ERRORS as exc:
            if "timeout" in str(exc).lower():
                return False
            raise StoreUnavailable(f"lost {self.describe()}: {exc}") from None

    def refresh_lease(self, key: str) -> None:
        self.add(key, 1)

    def lease_token(self, key: str) -> int:
        return self.add(key, 0)

    def rendezvous_store(self, prefix: str, timeout: float) -> Store:
        return PrefixStore(self.run_prefix + prefix, connect_store(self.addr, self.port, timeout))
