"""The run's key space on etcd, below the protocol: reads answered by the watch's copy
where it covers the key (`etcd_watch.Mirror`), writes fenced on a leader's claim when the
client is fenced, and the revision floor that gives a client its own writes back. Every
request goes through `call`, which counts it (the benchmark's request figures).
`control/etcd.py` builds the backend protocol on it.
"""

from __future__ import annotations

import base64
import time
from typing import Any

from unbroken.control.backend import Fenced, StoreUnavailable
from unbroken.control.etcd_gateway import EtcdGateway
from unbroken.control.etcd_watch import Kv, Mirror
from unbroken.control.schema import Watched

_RETRIES = 64  # compare-and-set rounds an atomic add may take under contention
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: the most requests one txn may carry


def b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdKv:
    """The keys under `run_prefix` on the cluster `gateway` speaks to."""

    def __init__(self, gateway: EtcdGateway, run_prefix: str) -> None:
        self.gateway = gateway
        self.run_prefix = run_prefix
        self.mirror: Mirror | None = None  # the watched keys' live copy (`watch`)
        self._floor = 0  # the revision of this client's last write to a watched key
        self._fence: dict[str, Any] | None = None  # the compare every write must pass
        self.requests = 0  # calls made to etcd
        self._unwatched = 0  # what `changes` counts down while no watch is live

    def describe(self) -> str:
        return self.gateway.describe()

    def watch(self, watched: list[Watched] | None) -> None:
        """Keep a live copy of `watched` (a watch stream): reads of those keys cost no
        request from then on. A different set replaces the stream, the same set is kept,
        None ends it."""
        if self.mirror is not None and watched is not None and self.mirror.watched == tuple(watched):
            return
        if self.mirror is not None:
            self.mirror.close()
            self.mirror = None
        if watched:
            self.mirror = Mirror(self.gateway, self.run_prefix, watched)

    def changes(self) -> int:
        """A number that moves whenever a watched key changed; without a live watch, a new
        number at every call (anything may have changed: read it all again)."""
        mirror = self.mirror
        if mirror is not None and mirror.live:
            return mirror.version
        self._unwatched -= 1
        return self._unwatched

    def wait_change(self, seen: int | None, timeout: float) -> None:
        """Sleep until a watched key changes (at most `timeout` seconds); without a live
        watch, for `timeout`."""
        mirror = self.mirror
        if mirror is None or not mirror.live or seen is None:
            time.sleep(timeout)
        else:
            mirror.wait_change(seen, timeout)

    def fence(self, key: str | None, value: str | None) -> None:
        """From now on every write of this client is a txn that holds only while `key`
        holds `value` (a leader's claim): once another agent has replaced it, the write is
        not made and `Fenced` is raised. `key` None lifts the fence (a leader that handed
        the lead over goes on as a follower)."""
        self._fence = None if key is None or value is None else {
            "key": self.path(key), "result": "EQUAL", "target": "VALUE", "value": b64(value)}

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.requests += 1
        return self.gateway.call(path, body)

    def write(self, ops: list[dict[str, Any]], key: str) -> dict[str, Any]:
        """Make the write `ops` (txn request ops on `key`), fenced if this client is; the
        reply's header."""
        if self._fence is None and len(ops) == 1 and "request_put" in ops[0]:
            reply = self.call("kv/put", ops[0]["request_put"])
        else:
            reply = self.call("kv/txn", {"compare": [self._fence] if self._fence else [],
                                          "success": ops})
            if self._fence is not None and not reply.get("succeeded"):
                raise Fenced(f"write to {key} refused: {unb64(self._fence['key']).decode()} "
                             "no longer holds this agent's claim (another agent leads now)")
        self._wrote(key, reply)
        return reply

    def _wrote(self, key: str, reply: dict[str, Any]) -> None:
        if self.mirror is not None and self.mirror.covers(key):
            self._floor = max(self._floor, int(reply["header"]["revision"]))

    def _mirrored(self, key: str, fresh: bool = False) -> Kv | None | bool:
        """The mirror's kv of `key` (None: unset), or False: ask etcd."""
        mirror = self.mirror
        if fresh or mirror is None:
            return False
        return mirror.get(key, self._floor)

    def path(self, key: str) -> str:
        """`key` under the run's prefix, as etcd's JSON carries it (base64)."""
        return b64(self.run_prefix + key)

    def range_one(self, key: str) -> dict[str, Any] | None:
        kvs = self.call("kv/range", {"key": self.path(key)}).get("kvs")
        return kvs[0] if kvs else None

    def ranges(self, keys: list[str], fresh: bool = False) -> list[bytes | None]:
        """The values of `keys` (None where unset), in order: from the mirror where it
        answers, the rest in one txn per MAX_TXN_OPS keys."""
        found = [self._mirrored(k, fresh) for k in keys]
        asked = [k for k, kv in zip(keys, found, strict=True) if kv is False]
        fetched = iter(self._fetch(asked))
        return [next(fetched) if kv is False else (None if kv is None else kv.value)
                for kv in found]

    def _fetch(self, keys: list[str]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for start in range(0, len(keys), MAX_TXN_OPS):
            chunk = keys[start:start + MAX_TXN_OPS]
            reply = self.call("kv/txn", {
                "success": [{"request_range": {"key": self.path(k)}} for k in chunk]})
            for response in reply["responses"]:
                kvs = response.get("response_range", {}).get("kvs")
                values.append(unb64(kvs[0].get("value", "")) if kvs else None)
        return values

    def txn(self, compare: dict[str, Any], key: str, value: str) -> tuple[bool, dict | None]:
        """Put `value` if `compare` holds (and the fence, if any); else read the key.
        (won, the key's kv if lost); `Fenced` if the fence failed."""
        fence = [self._fence] if self._fence else []
        reply = self.call("kv/txn", {
            "compare": [{"key": self.path(key), "result": "EQUAL", **compare}, *fence],
            "success": [{"request_put": {"key": self.path(key), "value": b64(value)}}],
            "failure": [{"request_range": {"key": self.path(key)}},
                        *({"request_range": {"key": f["key"]}} for f in fence)],
        })
        if reply.get("succeeded"):
            self._wrote(key, reply)
            return True, None
        responses = reply.get("responses") or [{}]
        if fence:
            held = responses[1].get("response_range", {}).get("kvs") or [{}]
            if held[0].get("value") != fence[0]["value"]:
                raise Fenced(f"write to {key} refused: another agent leads now")
        kvs = responses[0].get("response_range", {}).get("kvs")
        return False, kvs[0] if kvs else None

    def get_bytes(self, key: str) -> bytes | None:
        return self.ranges([key])[0]

    def set_bytes(self, key: str, value: bytes) -> None:
        self.write([{"request_put": {"key": self.path(key), "value": b64(value)}}], key)

    def floor_under(self, prefix: str) -> dict[str, Kv] | bool:
        """The mirror's keys under `prefix` (False: ask etcd)."""
        return self.mirror.under(prefix, self._floor) if self.mirror is not None else False

    def cas_add(self, key: str, amount: int) -> int:
        """An add on a single key holding the total (what a c10d store's `add` must be,
        for torch reads the key back with `get`): a compare-and-set, retried on races."""
        for _ in range(_RETRIES):
            kv = self.range_one(key)
            current = int(unb64(kv["value"]).decode() or 0) if kv and kv.get("value") else 0
            if amount == 0:
                return current
            if kv is None:
                compare = {"target": "CREATE", "create_revision": "0"}
            else:
                compare = {"target": "MOD", "mod_revision": kv["mod_revision"]}
            won, _ = self.txn(compare, key, str(current + amount))
            if won:
                return current + amount
        raise StoreUnavailable(f"add to {key} on {self.describe()}: lost {_RETRIES} races")

