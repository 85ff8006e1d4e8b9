"""The etcd v3 backend: the control store on an etcd cluster, so that it outlives any one host.

It speaks etcd's v3 JSON gateway (`/v3/kv/range`, `/v3/kv/put`, `/v3/kv/txn`) with the
standard library: no client package. Why not a client package (docs/design-notes.md, "The
etcd backend"): the widely used `etcd3` was last released in 2020 and fails to import with
the protobuf versions of today; the maintained gateway client `etcd3gw` has no
authentication and pulls in three packages; torch's own etcd stores speak the v2 API, which
etcd 3.4 (Debian's) disables by default. The gateway is on by default in etcd 3.4 and later.

Keys and values travel base64-encoded; integers in responses are strings; fields at their
zero value are left out of responses (a failed txn has no `succeeded`, an empty range no
`kvs`). Several endpoints may be given: a call goes to the first that answers.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

from torch.distributed import Store

from unbroken.control.backend import StoreUnavailable

_RETRIES = 64  # compare-and-set rounds an atomic add may take under contention


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdBackend:
    """`backend.Backend` over an etcd v3 cluster; `run_id` scopes every key to one run."""

    def __init__(self, endpoints: list[str], run_id: str, timeout: float = 5.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = [e if "://" in e else f"http://{e}" for e in endpoints]
        self.run_prefix = f"unbroken/{run_id}/"
        self.timeout = timeout

    def describe(self) -> str:
        return f"etcd at {','.join(self.endpoints)}"

    # ------------------------------------------------------------ transport
    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the first endpoint that answers; StoreUnavailable if none does."""
        data = json.dumps(body).encode()
        errors = []
        for i, endpoint in enumerate(self.endpoints):
            request = urllib.request.Request(f"{endpoint}/v3/{path}", data=data,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    if i:  # remember the one that answered
                        self.endpoints.insert(0, self.endpoints.pop(i))
                    return json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")[:200]
                raise StoreUnavailable(f"{self.describe()} refused {path}: HTTP {exc.code} "
                                       f"{detail}") from None
            except (urllib.error.URLError, OSError, TimeoutError) as exc:
                errors.append(f"{endpoint}: {getattr(exc, 'reason', exc)}")
        raise StoreUnavailable(f"cannot reach {self.describe()} ({'; '.join(errors)}); is etcd "
                               "running, and is --rdzv-endpoint right?")

    def _key(self, key: str) -> str:
        return _b64(self.run_prefix + key)

    def _range(self, key: str) -> dict[str, Any] | None:
        kvs = self._call("kv/range", {"key": self._key(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _txn(self, compare: dict[str, Any], key: str, value: str) -> tuple[bool, dict | None]:
        """Put `value` if `compare` holds; else read the key. (won, the key's kv if lost)."""
        reply = self._call("kv/txn", {
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

    def set(self, key: str, value: str) -> None:
        self.set_bytes(key, value.encode())

    def get_bytes(self, key: str) -> bytes | None:
        kv = self._range(key)
        return None if kv is None else _unb64(kv.get("value", ""))

    def set_bytes(self, key: str, value: bytes) -> None:
        self._call("kv/put", {"key": self._key(key), "value": _b64(value)})

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
        deadline = time.monotonic() + timeout
        pause = 0.001
        while True:
            if all(self._range(k) is not None for k in keys):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(0.05, pause * 2)

    def refresh_lease(self, key: str) -> None:
        self.add(key, 1)

    def lease_token(self, key: str) -> int:
        return self.add(key, 0)

    def rendezvous_store(self, prefix: str, timeout: float) -> Store:
        return EtcdStore(EtcdBackend(list(self.endpoints), "", self.timeout),
                         self.run_prefix + prefix, timeout)


class EtcdStore(Store):
    """A c10d `Store` on etcd, for process-group rendezvous: `init_process_group(store=...)`.

    Keys are under `prefix`; `get` blocks until the key is set or the store's timeout."""

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
        return self._backend.add(self._k(key), amount)

    def check(self, keys: list[str]) -> bool:
        return all(self._backend.get_bytes(self._k(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        if not self._backend.wait([self._k(k) for k in keys], limit):
            raise LookupError(f"keys {keys} not set within {limit:g}s")

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
