"""The embedded backend: a TCPStore served by the node-0 agent (the leader), never by a worker.

It needs nothing installed, and node 0 is its single point of failure: when the leader's
host dies, the job ends (exit 3). Each attempt's workers also get a store of their own on a
fresh port (`serve_store(port=0)`), so no key or connection of a dead attempt reaches a new one.
"""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from torch.distributed import PrefixStore, Store, TCPStore

from unbroken.control.backend import StoreUnavailable
from unbroken.control.schema import Watched
from unbroken.errors import ConfigError, ControlPlaneError

T = TypeVar("T")
_STORE_ERRORS = (RuntimeError, OSError)
_FEW = 4  # get_many: up to this many keys are read one by one  # what a TCPStore call raises when the server is gone
HOLE_AFTER = 2.0  # seconds an entry may stay unwritten behind written ones before readers skip it
_TOMBSTONE = "-"  # what a reader writes into an abandoned slot (a request id has no '-')


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


TORCH_DUMP_KEY = "exception_dump"
"""The key torch's NCCL heartbeat monitor polls at the root of a process group's store
(`ProcessGroupNCCL`'s global store: the store under every `PrefixStore`)."""


class TcpBackend:
    """`backend.Backend` over a TCPStore; `run_id` scopes every key to one run."""

    def __init__(self, store: Store, run_id: str, addr: str = "", port: int = 0) -> None:
        self.run_prefix = f"unbroken/{run_id}/"
        self._kv = PrefixStore(self.run_prefix, store)
        self.addr, self.port = addr, port
        self._store = store  # keeps a served store alive as long as the backend
        self.requests = 0  # calls made to the store (the benchmark's count)
        self._positions: dict[str, int] = {}  # request id -> the index its append took
        self._holes: dict[str, float] = {}  # entry key -> when a reader first found it missing

    @classmethod
    def connect(cls, addr: str, port: int, run_id: str, timeout: float) -> TcpBackend:
        return cls(connect_store(addr, port, timeout), run_id, addr, port)

    def describe(self) -> str:
        return f"the control store at {self.addr}:{self.port}"

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        self.requests += 1
        try:
            return fn(*args)
        except _STORE_ERRORS as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StoreUnavailable(f"lost {self.describe()} (node-0 agent gone?): {text}") from None

    def get(self, key: str, fresh: bool = False) -> str | None:
        if not self._call(self._kv.check, [key]):
            return None
        return self._call(self._kv.get, key).decode()

    def get_many(self, keys: list[str], fresh: bool = False) -> list[str | None]:
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

    def add(self, key: str, amount: int, request_id: str | None = None) -> int:
        """The TCPStore's own add: one round trip. It cannot tell a retry from a new add
        (`request_id` is not used): a retried add whose first reply was lost counts twice.
        Queues do not rest on it (`append`)."""
        return int(self._call(self._kv.add, key, amount))

    def increment(self, key: str, request_id: str | None = None) -> None:
        self.add(key, 1)

    def notify(self, key: str) -> None:
        self.add(key, 1)

    # ------------------------------------------------------------ queues
    def append(self, queue: str, request_id: str, value: str) -> None:
        """Take a slot with the counter (`<queue>/n`: every writer its own, no contention),
        say which in a marker (`<queue>/rid/<id>`), then fill the slot by compare-and-set
        with `value` tagged by the request id. A retry reads the marker and fills (or finds
        filled) the same slot. A slot whose add's reply was lost stays empty and readers
        skip it after HOLE_AFTER (they fill it with a tombstone first, so a writer merely
        slow to fill it loses its slot and takes another)."""
        tagged = f"{request_id} {value}"
        marker = f"{queue}/rid/{request_id}"
        taken = self.get(marker)  # set: an earlier try of this append took that slot
        index = int(taken) if taken is not None else None
        while True:
            if index is None:
                index = self.add(f"{queue}/n", 1) - 1
                self.set(marker, str(index))
            if self.compare_set(f"{queue}/{index}", None, tagged) == tagged:
                self._positions[request_id] = index
                return
            index = None  # tombstoned by a reader: take another slot

    def read_queue(self, queue: str, start: int) -> list[tuple[str | None, str | None]]:
        count = self.add(f"{queue}/n", 0)
        keys = [f"{queue}/{i}" for i in range(start, count)]
        found: list[tuple[str | None, str | None]] = []
        for key, raw in zip(keys, self.get_many(keys), strict=True):
            if raw is None:
                raw = self._abandoned(key)
                if raw is None:
                    break  # being written: read again next time
            if raw == _TOMBSTONE:
                found.append((None, None))
                continue
            rid, _, value = raw.partition(" ")
            found.append((rid, value))
        return found

    def _abandoned(self, key: str) -> str | None:
        """A slot still empty HOLE_AFTER after a reader first found it so: tombstoned (or,
        if its writer fills it first, what it wrote); None while it may still be filled."""
        first = self._holes.setdefault(key, time.monotonic())
        if time.monotonic() - first < HOLE_AFTER:
            return None
        del self._holes[key]
        return self.compare_set(key, None, _TOMBSTONE)

    def position(self, queue: str, request_id: str) -> int:
        if request_id in self._positions:
            return self._positions[request_id]
        for index, (rid, _) in enumerate(self.read_queue(queue, 0)):
            if rid == request_id:
                return index
        raise KeyError(f"no entry {request_id} in {queue}")

    # ------------------------------------------------------------ no watches, no fences
    def watch(self, watched: list[Watched] | None) -> None:
        """Nothing: the TCPStore cannot watch; readers poll, paced by their callers."""


    def changes(self) -> int | None:
        return None

    def wait_change(self, seen: int | None, timeout: float) -> None:
        time.sleep(timeout)

    def fence(self, key: str | None, value: str | None) -> None:
        """Nothing: the store's host is the only leader there is, and cannot be deposed."""

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


    def rendezvous_store(self, prefix: str, timeout: float) -> Store:
        return rendezvous_on(connect_store(self.addr, self.port, timeout),
                             self.run_prefix + prefix)


def rendezvous_on(store: Store, prefix: str) -> Store:
    """`store` under `prefix`, for a generation's process groups, with torch's
    `exception_dump` key deleted at its root first: torch's NCCL heartbeat monitor polls it
    there, past every prefix, and a key one generation's failure left would make it kill
    every later process (nccl-risks, risk 3). Every member of every generation clears it
    before it forms its groups (the etcd backend needs nothing: each generation's store
    has a prefix of its own, which the monitor reads under)."""
    store.delete_key(TORCH_DUMP_KEY)
    return PrefixStore(prefix, store)
