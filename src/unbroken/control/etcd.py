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
`kvs`). Several endpoints may be given: a call goes to the first that answers.

Security, as etcdctl does it: an `https://` endpoint (or a bare HOST:PORT when a CA or a
client certificate is given) is verified against `cacert` (the system's CAs if None) and
presents the client certificate `cert`/`key` if given; a `user` authenticates with its
password on the first call and again whenever etcd forgets the token (it expires after
--auth-token-ttl idle seconds), and the token goes in the `Authorization` header. A wrong
setting is one line that says what is wrong and which flag fixes it; no message carries the
password or the token.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from datetime import timedelta
from typing import Any

from torch.distributed import Store

from unbroken.control.backend import StoreMisconfigured, StoreUnavailable
from unbroken.polling import Backoff, PollTimeout, poll_until

_RETRIES = 64  # compare-and-set rounds an atomic add may take under contention
_MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: the most requests one txn may carry
_UNKNOWN_CA = {2, 18, 19, 20, 21}  # OpenSSL's verify codes for an issuer we do not trust
_HOSTNAME_MISMATCH = 62  # X509_V_ERR_HOSTNAME_MISMATCH
# What etcd answers when it no longer knows our token (expired, or the auth store changed),
# or when auth was enabled after we found it off.
_STALE_TOKEN = ("invalid auth token", "auth store is old", "user name is empty")
_PASSWORD_HINT = "check --etcd-user and the password in UNBROKEN_ETCD_PASSWORD"


def _b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _reason(exc: BaseException) -> str:
    """An OpenSSL or OS error without its `[LIB: CODE]` prefix and `(_ssl.c:N)` suffix."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return re.sub(r"^\[[^]]*\] | \(_ssl\.c:\d+\)$", "", text)


def _tls_context(cacert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """Verifies etcd against `cacert` (the system's CAs if None), hostname included, and
    presents the client certificate `cert` (its key in `key`, or in `cert` if None).
    StoreUnavailable, one line, if a file cannot be loaded."""
    try:
        context = ssl.create_default_context(cafile=cacert)
    except OSError as exc:
        raise StoreMisconfigured(f"cannot load etcd's CA from --etcd-cacert {cacert}: "
                               f"{_reason(exc)}") from None
    if key is not None and cert is None:
        raise StoreMisconfigured("--etcd-key given without --etcd-cert: pass both")
    if cert is not None:
        try:
            context.load_cert_chain(cert, key)
        except OSError as exc:
            raise StoreMisconfigured(f"cannot load the client certificate --etcd-cert {cert} "
                                   f"--etcd-key {key}: {_reason(exc)}") from None
    return context


def _speaks_tls(endpoint: str, timeout: float) -> bool:
    """Does the server at `endpoint` answer a TLS handshake (whatever its certificate)?"""
    url = urllib.parse.urlsplit(endpoint)
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((url.hostname, url.port or 2379), timeout) as raw, \
                probe.wrap_socket(raw):
            return True
    except ssl.SSLError as exc:  # a TLS alert is a TLS answer (a refused client certificate)
        return "ALERT" in (exc.reason or "")
    except OSError:
        return False


class EtcdBackend:
    """`backend.Backend` over an etcd v3 cluster; `run_id` scopes every key to one run.

    `cacert`, `cert` and `key` are PEM file paths for TLS (see the module's docstring);
    `user` and `password` log in to etcd when its authentication is enabled. Bad TLS files
    raise StoreUnavailable here; everything else is found on the first call."""

    def __init__(self, endpoints: list[str], run_id: str, timeout: float = 5.0, *,
                 cacert: str | None = None, cert: str | None = None, key: str | None = None,
                 user: str | None = None, password: str | None = None) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        scheme = "https" if cacert or cert else "http"
        self.endpoints = [e if "://" in e else f"{scheme}://{e}" for e in endpoints]
        self.run_id = run_id
        self.run_prefix = f"unbroken/{run_id}/"
        self._leases: dict[str, int] = {}  # lease key -> the token this holder last wrote
        self.timeout = timeout
        self._files = {"cacert": cacert, "cert": cert, "key": key}
        tls = any(e.startswith("https://") for e in self.endpoints)
        self._tls = _tls_context(cacert, cert, key) if tls else None
        self.user = user
        self._password = password
        self._token: str | None = None  # None: not logged in yet; "": etcd has auth off
        self._local = threading.local()  # each thread's kept-alive connections

    def describe(self) -> str:
        return f"etcd at {','.join(self.endpoints)}"

    # ------------------------------------------------------------ transport
    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the first endpoint that answers, logged in as `user` if given (again
        once if etcd has forgotten the token); its JSON reply, or StoreUnavailable."""
        if self.user is not None and self._token is None:
            self._authenticate()
        status, reply = self._post(path, body)
        if status != 200 and self.user is not None and (
                status == 401 or any(s in self._message(reply) for s in _STALE_TOKEN)):
            self._authenticate()
            status, reply = self._post(path, body)
        if status != 200:
            error = StoreMisconfigured if 400 <= status < 500 else StoreUnavailable
            raise error(self._refusal(path, status, reply))
        return reply

    def _authenticate(self) -> None:
        """Get a token for `user` (none needed if etcd has auth off); StoreUnavailable,
        one line without the password, if etcd refuses."""
        if self._password is None:
            raise StoreMisconfigured(f"no password for etcd user {self.user!r}: set "
                                   "UNBROKEN_ETCD_PASSWORD")
        self._token = None
        status, reply = self._post("auth/authenticate",
                                   {"name": self.user, "password": self._password})
        message = self._message(reply)
        if status == 200:
            self._token = reply["token"]
        elif "authentication is not enabled" in message:
            self._token = ""
        elif "authentication failed" in message:
            raise StoreMisconfigured(f"{self.describe()} refused user {self.user!r}: "
                                   f"authentication failed; {_PASSWORD_HINT}")
        else:
            raise StoreMisconfigured(self._refusal("auth/authenticate", status, reply))

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON reply) of the first endpoint that answers; StoreUnavailable if
        none does: the first misconfiguration found (TLS), else every endpoint's error."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        misconfigured, unreachable = [], []
        for i, endpoint in enumerate(self.endpoints):
            try:
                status, raw = self._request(endpoint, f"/v3/{path}", data, headers)
            except (OSError, http.client.HTTPException) as exc:
                wrong = self._misconfiguration(endpoint, exc)
                if wrong:
                    misconfigured.append(wrong)
                else:
                    unreachable.append(f"{endpoint}: {_reason(getattr(exc, 'reason', exc))}")
                continue
            if i:  # remember the one that answered
                self.endpoints.insert(0, self.endpoints.pop(i))
            try:
                return status, json.loads(raw or b"{}")
            except ValueError:
                return status, {"message": raw.decode(errors="replace")[:200]}
        if misconfigured:
            raise StoreMisconfigured(misconfigured[0])
        raise StoreUnavailable(f"cannot reach {self.describe()} ({'; '.join(unreachable)}); is "
                               "etcd running, and is --rdzv-endpoint right?")

    def _request(self, endpoint: str, path: str, data: bytes,
                 headers: dict[str, str]) -> tuple[int, bytes]:
        """One POST on this thread's kept-alive connection to `endpoint` (a new connection
        per call would cost a TCP, and with TLS a TLS, handshake each time: the agents
        read the control plane at every look). A connection the server closed while idle
        is replaced once; any other failure closes it and is raised."""
        conns = self._local.__dict__.setdefault("conns", {})
        for attempt in (0, 1):
            conn = conns.get(endpoint)
            fresh = conn is None
            if fresh:
                url = urllib.parse.urlsplit(endpoint)
                if url.scheme == "https":
                    conn = http.client.HTTPSConnection(url.hostname, url.port, timeout=self.timeout,
                                                       context=self._tls)
                else:
                    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=self.timeout)
                conns[endpoint] = conn
            try:
                conn.request("POST", path, body=data, headers=headers)
                response = conn.getresponse()
                return response.status, response.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                del conns[endpoint]
                stale = isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError,
                                         ConnectionResetError))
                if fresh or not stale or attempt:
                    raise
        raise AssertionError("unreachable")

    def _misconfiguration(self, endpoint: str, exc: BaseException) -> str | None:
        """What is wrong with our TLS settings for `endpoint`, given how a call failed; None
        if the failure says nothing about them (refused, timed out: etcd is not there)."""
        error = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        where = f"etcd at {endpoint}"
        if isinstance(error, ssl.SSLCertVerificationError):
            if error.verify_code == _HOSTNAME_MISMATCH:
                host = urllib.parse.urlsplit(endpoint).hostname
                return (f"TLS handshake with {where}: certificate verify failed (it is not valid "
                        f"for {host!r}); use a host name or IP address that etcd's certificate "
                        "lists in its subjectAltName")
            what = "unknown CA" if error.verify_code in _UNKNOWN_CA else error.verify_message
            return (f"TLS handshake with {where}: certificate verify failed ({what}); pass the "
                    "CA that signed etcd's certificate with --etcd-cacert")
        # A server that speaks the other protocol closes the connection, resets it or answers
        # garbage; so does a TLS server that refuses our client certificate. Ask it.
        if not isinstance(error, (ssl.SSLError, ConnectionError, http.client.HTTPException)):
            return None
        tls = _speaks_tls(endpoint, self.timeout)
        if not endpoint.startswith("https://"):
            return f"{where} expects TLS: use an https:// endpoint" if tls else None
        if not tls:
            return f"{where} does not speak TLS: use an http:// endpoint"
        if self._files["cert"] is None:
            return (f"{where} requires a client certificate (it runs with --client-cert-auth): "
                    "pass one with --etcd-cert and --etcd-key")
        if isinstance(error, ssl.SSLError):
            return (f"{where} refused the client certificate {self._files['cert']}: pass one "
                    "signed by a CA in etcd's --trusted-ca-file")
        return None

    @staticmethod
    def _message(reply: dict[str, Any]) -> str:
        return str(reply.get("message") or reply.get("error") or "")

    def _refusal(self, path: str, status: int, reply: dict[str, Any]) -> str:
        """One line for an HTTP error from etcd; never the password or the token."""
        message = self._message(reply)
        if "user name is empty" in message:
            return (f"{self.describe()} has authentication enabled: pass a user with "
                    "--etcd-user and its password in UNBROKEN_ETCD_PASSWORD")
        if "permission denied" in message:
            return (f"{self.describe()} denied user {self.user!r} {path}: grant it a role with "
                    "readwrite permission on the keys under 'unbroken/'")
        for secret in (self._password, self._token):
            if secret:
                message = message.replace(secret, "***")
        return f"{self.describe()} refused {path}: HTTP {status} {message}"

    def _key(self, key: str) -> str:
        return _b64(self.run_prefix + key)

    def _range(self, key: str) -> dict[str, Any] | None:
        kvs = self._call("kv/range", {"key": self._key(key)}).get("kvs")
        return kvs[0] if kvs else None

    def _ranges(self, keys: list[str]) -> list[bytes | None]:
        """The values of `keys` (None where unset), in order: one txn per _MAX_TXN_OPS keys."""
        values: list[bytes | None] = []
        for start in range(0, len(keys), _MAX_TXN_OPS):
            chunk = keys[start:start + _MAX_TXN_OPS]
            reply = self._call("kv/txn", {
                "success": [{"request_range": {"key": self._key(k)}} for k in chunk]})
            for response in reply["responses"]:
                kvs = response.get("response_range", {}).get("kvs")
                values.append(_unb64(kvs[0].get("value", "")) if kvs else None)
        return values

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

    def get_many(self, keys: list[str]) -> list[str | None]:
        """The values of `keys`, in order, None where unset: one round trip per 128 keys."""
        return [None if raw is None else raw.decode() for raw in self._ranges(keys)]

    def set(self, key: str, value: str) -> None:
        self.set_bytes(key, value.encode())

    def delete_prefix(self) -> None:
        """Delete every key of the run (its rendezvous stores' included); other runs' stay."""
        end = self.run_prefix[:-1] + "0"  # the first key past the prefix: '0' follows '/'
        self._call("kv/deleterange", {"key": _b64(self.run_prefix), "range_end": _b64(end)})

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
        return len(self._call("kv/range", body).get("kvs", []))

    def increment(self, key: str) -> None:
        """Add one, without learning the value: a single put."""
        self._put_tally(key)

    def _put_tally(self, key: str) -> str:
        reply = self._call("kv/put", {"key": self._key(f"{key}#{uuid.uuid4().hex}"),
                                      "value": _b64("1")})
        return reply["header"]["revision"]

    def _tally_range(self, key: str) -> dict[str, Any]:
        start = self.run_prefix + key + "#"
        return {"key": _b64(start), "range_end": _b64(start[:-1] + "$")}  # '$' follows '#'

    def _tally(self, key: str) -> int:
        body = {**self._tally_range(key), "count_only": True}
        return int(self._call("kv/range", body).get("count", 0))

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
        own = EtcdBackend(list(self.endpoints), self.run_id, self.timeout, **self._files,
                          user=self.user, password=self._password)
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
