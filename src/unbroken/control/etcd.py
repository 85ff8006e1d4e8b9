"""The etcd v3 backend: the control store on an etcd cluster, so that it outlives any one host.

It speaks etcd's v3 JSON gateway (`/v3/kv/range`, `/v3/kv/put`, `/v3/kv/txn`,
`/v3/kv/deleterange`, `/v3/auth/authenticate`) with the standard library: no client package.
Why not a client package (docs/design-notes.md, "The etcd backend"): the widely used `etcd3`
was last released in 2020 and fails to import with the protobuf versions of today; the
maintained gateway client `etcd3gw` has no authentication and pulls in three packages; torch's
own etcd stores speak the v2 API, which etcd 3.4 (Debian's) disables by default. The gateway
is on by default in etcd 3.4 and later.

Keys and values travel base64-encoded; integers in responses are strings; fields at their
zero value are left out of responses (a failed txn has no `succeeded`, an empty range no
`kvs`). The transport (endpoints, TLS, users and tokens, the one-line refusals) is the
gateway client's, `control/etcd_gateway.py`; this module is the key space and the protocol.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from torch.distributed import Store

from unbroken.control.etcd_gateway import EtcdGateway
from unbroken.control.etcd_kv import EtcdKv, b64, unb64
from unbroken.control.schema import Watched
from unbroken.polling import Backoff, PollTimeout, poll_until


class EtcdBackend:
    """`backend.Backend` over an etcd v3 cluster; `run_id` scopes every key to one run.

    `cacert`, `cert` and `key` are PEM file paths for TLS, `user` and `password` log in to
    etcd (control/etcd_gateway.py). Bad TLS files raise StoreMisconfigured here; everything
    else is found on the first call."""

    def __init__(self, endpoints: list[str], run_id: str, timeout: float = 5.0, *,
                 cacert: str | None = None, cert: str | None = None, key: str | None = None,
                 user: str | None = None, password: str | None = None) -> None:
        self._gateway = EtcdGateway(endpoints, timeout, cacert=cacert, cert=cert, key=key,
                                    user=user, password=password)
        self.run_id = run_id
        self.run_prefix = f"unbroken/{run_id}/"
        self.kv = EtcdKv(self._gateway, self.run_prefix)
        self._leases: dict[str, int] = {}  # lease key -> the token this holder last wrote
        self._cursors: dict[str, tuple[int, int]] = {}  # queue -> (index, create revision)

    # ------------------------------------------------------------ watches and fencing
    def watch(self, watched: list[Watched] | None) -> None:
        """Keep a live copy of `watched` (None: stop): reads of them cost no request."""
        self.kv.watch(watched)

    def changes(self) -> int | None:
        """Moves at every change of a watched key (no request); a new number at every call
        while no watch is live."""
        return self.kv.changes()

    def wait_change(self, seen: int | None, timeout: float) -> None:
        self.kv.wait_change(seen, timeout)

    def fence(self, key: str | None, value: str | None) -> None:
        self.kv.fence(key, value)

    @property
    def endpoints(self) -> list[str]:
        """The cluster's endpoints, the one that last answered first."""
        return self._gateway.endpoints

    def describe(self) -> str:
        return self._gateway.describe()

    # ------------------------------------------------------------ the protocol
    def get(self, key: str, fresh: bool = False) -> str | None:
        """The value of `key`: from the mirror if it covers the key (no request), unless
        `fresh` (asked of etcd: a decision that must not rest on a copy, such as a silence)."""
        raw = self.kv.ranges([key], fresh)[0]
        return None if raw is None else raw.decode()

    def get_many(self, keys: list[str], fresh: bool = False) -> list[str | None]:
        """The values of `keys`, in order, None where unset: the mirror's, or one round trip
        per 128 keys it does not answer."""
        return [None if raw is None else raw.decode() for raw in self.kv.ranges(keys, fresh)]

    def set(self, key: str, value: str) -> None:
        self.kv.set_bytes(key, value.encode())

    def delete_prefix(self) -> None:
        """Delete every key of the run (its rendezvous stores' included); other runs' stay."""
        end = self.run_prefix[:-1] + "0"  # the first key past the prefix: '0' follows '/'
        self.kv.write([{"request_delete_range": {"key": b64(self.run_prefix),
                                               "range_end": b64(end)}}], "")

    def compare_set(self, key: str, expected: str | None, desired: str) -> str:
        if expected is None:
            compare = {"target": "CREATE", "create_revision": "0"}
        else:
            compare = {"target": "VALUE", "value": b64(expected)}
        won, kv = self.kv.txn(compare, key, desired)
        if won:
            return desired
        return "" if kv is None else unb64(kv.get("value", "")).decode()

    def add(self, key: str, amount: int, request_id: str | None = None) -> int:
        """A counter is a tally: one key under `<key>#` per unit added, so that adds never
        race (a compare-and-set counter makes N concurrent adders retry O(N) times each).
        The tally key is named by the request id, so a retry whose first try was applied
        puts the same key again and counts once. The create revisions order the adds, so
        each adder learns its own position: the tally keys created up to its own (etcd's
        `count` ignores revision filters, so they are listed, keys only: for claims, which
        are few; `increment` learns nothing and lists nothing)."""
        if amount < 0:
            raise ValueError("counters only grow")
        if amount == 0:
            return self._tally(key)
        rid = request_id or uuid.uuid4().hex
        revision = 0
        for unit in range(amount):
            revision = self._put_tally(key, f"{rid}.{unit}")
        body = {**self._tally_range(key), "keys_only": True, "max_create_revision": str(revision)}
        return len(self.kv.call("kv/range", body).get("kvs", []))

    def increment(self, key: str, request_id: str | None = None) -> None:
        """Add one, without learning the value: a single put."""
        self._put_tally(key, request_id or uuid.uuid4().hex)

    def _put_tally(self, key: str, name: str) -> int:
        """Put the tally key `name`; its create revision (the first put's, on a retry)."""
        reply = self.kv.write([{"request_put": {"key": self.kv.path(f"{key}#{name}"),
                                              "value": b64("1"), "prev_kv": True}}], key)
        prev = reply.get("prev_kv") or (reply.get("responses") or [{}])[0] \
            .get("response_put", {}).get("prev_kv")
        return int(prev["create_revision"]) if prev else int(reply["header"]["revision"])

    def _tally_range(self, key: str) -> dict[str, Any]:
        start = self.run_prefix + key + "#"
        return {"key": b64(start), "range_end": b64(start[:-1] + "$")}  # '$' follows '#'

    def _tally(self, key: str) -> int:
        under = self.kv.floor_under(key + "#")
        if under is not False:
            return len(under)
        body = {**self._tally_range(key), "count_only": True}
        return int(self.kv.call("kv/range", body).get("count", 0))

    # ------------------------------------------------------------ queues
    def notify(self, key: str) -> None:
        """Nothing: whoever waits on news watches the keys whose writes are the news."""

    def append(self, queue: str, request_id: str, value: str) -> None:
        """One put, of `<queue>/<request id>`: a retry puts the same key (one entry, whose
        place is its first put's), and no index is taken, so nothing is listed and no gap
        can open. Readers order the entries by create revision."""
        self.kv.write([{"request_put": {"key": self.kv.path(f"{queue}/{request_id}"),
                                      "value": b64(value)}}], queue)

    def read_queue(self, queue: str, start: int) -> list[tuple[str | None, str | None]]:
        """(entry key, value) of the entries from index `start` on, in append order: from
        the mirror if it covers the queue, else one range of the entries created since the
        last read (this client remembers where it stopped)."""
        under = self.kv.floor_under(queue + "/")
        if under is not False:
            kvs = sorted(under.items(), key=lambda item: item[1].create_revision)[start:]
            return [(k.rsplit("/", 1)[1], kv.value.decode()) for k, kv in kvs]
        body: dict[str, Any] = {**self._queue_range(queue), "sort_target": "CREATE",
                                "sort_order": "ASCEND"}
        base, revision = self._cursors.get(queue, (0, 0))
        if not 0 < base <= start:
            base = 0  # read from the first entry
        else:
            body["min_create_revision"] = str(revision + 1)
        kvs = self.kv.call("kv/range", body).get("kvs", [])
        if kvs:
            self._cursors[queue] = (base + len(kvs), int(kvs[-1]["create_revision"]))
        return [(unb64(kv["key"]).decode().rsplit("/", 1)[1],
                 unb64(kv.get("value", "")).decode()) for kv in kvs[start - base:]]

    def position(self, queue: str, request_id: str) -> int:
        """The index of the entry appended under `request_id` (a listing, keys only: for
        the few queues whose writers wait on an answer by index, such as drains)."""
        body = {**self._queue_range(queue), "keys_only": True, "sort_target": "CREATE",
                "sort_order": "ASCEND"}
        keys = [unb64(kv["key"]).decode() for kv in self.kv.call("kv/range", body).get("kvs", [])]
        return keys.index(f"{self.run_prefix}{queue}/{request_id}")

    def _queue_range(self, queue: str) -> dict[str, str]:
        start = f"{self.run_prefix}{queue}/"
        return {"key": b64(start), "range_end": b64(start[:-1] + "0")}  # '0' follows '/'

    def wait(self, keys: list[str], timeout: float) -> bool:
        """Wait for `keys` to be set: woken by the watch where it covers them, else polled."""
        def all_there() -> bool | None:
            if all(raw is not None for raw in self.kv.ranges(keys)):
                return True
            if self.kv.mirror is not None and all(self.kv.mirror.covers(k) for k in keys):
                self.kv.wait_change(self.kv.changes(), 0.25)
            return None

        try:
            return poll_until(all_there, timeout, Backoff(0.001, 2.0, 0.05), what="the keys")
        except PollTimeout:
            return False

    def refresh_lease(self, key: str) -> None:
        """One put: only the holder writes its lease, so its own count is the token."""
        self._leases[key] = self._leases.get(key, 0) + 1
        self.set(key, str(self._leases[key]))

    def rendezvous_store(self, prefix: str, timeout: float) -> Store:
        gateway = self._gateway
        own = EtcdBackend(list(gateway.endpoints), self.run_id, gateway.timeout,
                          **gateway.settings())
        return EtcdStore(own, prefix, timeout)


class EtcdStore(Store):
    """A c10d `Store` on etcd, for process-group rendezvous: `init_process_group(store=...)`.

    Keys are under `prefix`, within the backend's run; `get` blocks until the key is set or
    the store's timeout."""

    def __init__(self, backend: EtcdBackend, prefix: str, timeout: float) -> None:
        super().__init__()
        self._backend = backend
        self._kv = backend.kv
        self._prefix = prefix
        self._timeout = timedelta(seconds=timeout)

    def _k(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._kv.set_bytes(self._k(key), value if isinstance(value, bytes) else value.encode())

    def get(self, key: str) -> bytes:
        if not self._backend.wait([self._k(key)], self._timeout.total_seconds()):
            raise LookupError(f"key {key!r} not set within {self._timeout}")
        return self._kv.get_bytes(self._k(key)) or b""

    def add(self, key: str, amount: int) -> int:
        return self._kv.cas_add(self._k(key), amount)

    def check(self, keys: list[str]) -> bool:
        return all(self._kv.get_bytes(self._k(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        if not self._backend.wait([self._k(k) for k in keys], limit):
            raise LookupError(f"keys {keys} not set within {limit:g}s")

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
