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

import base64
import uuid
from datetime import timedelta
from typing import Any

from torch.distributed import Store

from unbroken.control.backend import StoreUnavailable
from unbroken.control.etcd_gateway import EtcdGateway
from unbroken.polling import Backoff, PollTimeout, poll_until

_RETRIES = 64  # compare-and-set rounds an atomic add may take under contention
_MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: the most requests one txn may carry


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


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
        self._leases: dict[str, int] = {}  # lease key -> the token this holder last wrote

    @property
    def endpoints(self) -> list[str]:
        """The cluster's endpoints, the one that last answered first."""
        return self._gateway.endpoints

    def describe(self) -> str:
        return self._gateway.describe()

    def _key(self, key: str) -> str:
        return _b64(self.run_prefix + key)

    def _range(self, key: str) -> dict[str, Any] | None:
        kvs = self._gateway.call("kv/range", {"key": self._key(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _ranges(self, keys: list[str]) -> list[bytes | None]:
        """The values of `keys` (None where unset), in order: one txn per _MAX_TXN_OPS keys."""
        values: list[bytes | None] = []
        for start in range(0, len(keys), _MAX_TXN_OPS):
            chunk = keys[start:start + _MAX_TXN_OPS]
            reply = self._gateway.call("kv/txn", {
                "success": [{"request_range": {"key": self._key(k)}} for k in chunk]})
            for response in reply["responses"]:
                kvs = response.get("response_range", {}).get("kvs")
                values.append(_unb64(kvs[0].get("value", "")) if kvs else None)
        return values

    def _txn(self, compare: dict[str, Any], key: str, value: str) -> tuple[bool, dict | None]:
        """Put `value` if `compare` holds; else read the key. (won, the key's kv if lost)."""
        reply = self._gateway.call("kv/txn", {
            "compare": [{"key": self._key(key), "result": "EQUAL", **compare}],
            "success": [{"request_put": {"key": self._key(key), "value": _b64(value)}}],
            "failure": [{"request_range": {"key": self._key(key)}}],
        })
        if reply.get("succeeded"):
            return True, None
        ranged = (reply.get("responses") or [{}])[0].get("response_range", {})
        kvs = ranged.get("kvs")
        return False, kvs[0] if kvs else None

    # ------------------------------------------------------------ the protocol
    def get(self, key: str) -> str | None:
        raw = self.get_bytes(key)
        return None if raw is None else raw.decode()

    def get_many(self, keys: list[str]) -> list[str | None]:
        """The values of `keys`, in order, None where unset: one round trip per 128 keys."""
        return [None if raw is None else raw.decode() for raw in self._ranges(keys)]

    def set(self, key: str, value: str) -> None:
        self.set_bytes(key, value.encode())

    def delete_prefix(self) -> None:
        """Delete every key of the run (its rendezvous stores' included); other runs' stay."""
        end = self.run_prefix[:-1] + "0"  # the first key past the prefix: '0' follows '/'
        self._gateway.call("kv/deleterange", {"key": _b64(self.run_prefix), "range_end": _b64(end)})

    def get_bytes(self, key: str) -> bytes | None:
        kv = self._range(key)
        return None if kv is None else _unb64(kv.get("value", ""))

    def set_bytes(self, key: str, value: bytes) -> None:
        self._gateway.call("kv/put", {"key": self._key(key), "value": _b64(value)})

    def compare_set(self, key: str, expected: str | None, desired: str) -> str:
        if expected is None:
            compare = {"target": "CREATE", "create_revision": "0"}
        else:
            compare = {"target": "VALUE", "value": _b64(expected)}
        won, kv = self._txn(compare, key, desired)
        if won:
            return desired
        return "" if kv is None else _unb64(kv.get("value", "")).decode()

    def add(self, key: str, amount: int) -> int:
        """A counter is a tally: one key under `<key>#` per unit added, so that adds never
        race (a compare-and-set counter makes N concurrent adders retry O(N) times each).
        The create revisions order the adds, so each adder learns its own position: the
        tally keys created up to its own (etcd's `count` ignores revision filters, so they
        are listed, keys only: O(value) bytes, for queue indexes and claims)."""
        if amount < 0:
            raise ValueError("counters only grow")
        if amount == 0:
            return self._tally(key)
        revision = None
        for _ in range(amount):
            revision = self._put_tally(key)
        body = {**self._tally_range(key), "keys_only": True, "max_create_revision": revision}
        return len(self._gateway.call("kv/range", body).get("kvs", []))

    def increment(self, key: str) -> None:
        """Add one, without learning the value: a single put."""
        self._put_tally(key)

    def _put_tally(self, key: str) -> str:
        reply = self._gateway.call("kv/put", {"key": self._key(f"{key}#{uuid.uuid4().hex}"),
                                      "value": _b64("1")})
        return reply["header"]["revision"]

    def _tally_range(self, key: str) -> dict[str, Any]:
        start = self.run_prefix + key + "#"
        return {"key": _b64(start), "range_end": _b64(start[:-1] + "$")}  # '$' follows '#'

    def _tally(self, key: str) -> int:
        body = {**self._tally_range(key), "count_only": True}
        return int(self._gateway.call("kv/range", body).get("count", 0))

    def cas_add(self, key: str, amount: int) -> int:
        """An add on a single key holding the total (what a c10d store's `add` must be,
        for torch reads the key back with `get`): a compare-and-set, retried on races."""
        for _ in range(_RETRIES):
            kv = self._range(key)
            current = int(_unb64(kv["value"]).decode() or 0) if kv and kv.get("value") else 0
            if amount == 0:
                return current
            if kv is None:
                compare = {"target": "CREATE", "create_revision": "0"}
            else:
                compare = {"target": "MOD", "mod_revision": kv["mod_revision"]}
            won, _ = self._txn(compare, key, str(current + amount))
            if won:
                return current + amount
        raise StoreUnavailable(f"add to {key} on {self.describe()}: lost {_RETRIES} races")

    def wait(self, keys: list[str], timeout: float) -> bool:
        def all_there() -> bool | None:
            return True if all(raw is not None for raw in self._ranges(keys)) else None

        try:
            return poll_until(all_there, timeout, Backoff(0.001, 2.0, 0.05), what="the keys")
        except PollTimeout:
            return False

    def refresh_lease(self, key: str) -> None:
        """One put: only the holder writes its lease, so its own count is the token."""
        self._leases[key] = self._leases.get(key, 0) + 1
        self.set(key, str(self._leases[key]))

    def lease_token(self, key: str) -> int:
        return int(self.get(key) or 0)

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
        self._prefix = prefix
        self._timeout = timedelta(seconds=timeout)

    def _k(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._backend.set_bytes(self._k(key), value if isinstance(value, bytes) else value.encode())

    def get(self, key: str) -> bytes:
        if not self._backend.wait([self._k(key)], self._timeout.total_seconds()):
            raise LookupError(f"key {key!r} not set within {self._timeout}")
        return self._backend.get_bytes(self._k(key)) or b""

    def add(self, key: str, amount: int) -> int:
        return self._backend.cas_add(self._k(key), amount)

    def check(self, keys: list[str]) -> bool:
        return all(self._backend.get_bytes(self._k(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        if not self._backend.wait([self._k(k) for k in keys], limit):
            raise LookupError(f"keys {keys} not set within {limit:g}s")

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
