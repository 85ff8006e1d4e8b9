"""etcd's v3 JSON gateway as a client: one POST to the first endpoint that answers, over TLS
and as a user when so configured, and every refusal as one line that says what is wrong.

It speaks HTTP and JSON with the standard library (docs/design-notes.md, "The etcd backend",
says why no client package); `control/etcd.py` builds the backend protocol on its `call`.
Several endpoints may be given: a call goes to the first that answers, and that one is asked
first from then on.

Security, as etcdctl does it: an `https://` endpoint (or a bare HOST:PORT when a CA or a
client certificate is given) is verified against `cacert` (the system's CAs if None) and
presents the client certificate `cert`/`key` if given; a `user` authenticates with its
password on the first call and again whenever etcd forgets the token (it expires after
--auth-token-ttl idle seconds), and the token goes in the `Authorization` header. A wrong
setting is one line that says what is wrong and which flag fixes it; no message carries the
password or the token.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
import threading
import urllib.error
import urllib.parse
from typing import Any

from unbroken.control.backend import StoreMisconfigured, StoreUnavailable

_UNKNOWN_CA = {2, 18, 19, 20, 21}  # OpenSSL's verify codes for an issuer we do not trust
_HOSTNAME_MISMATCH = 62  # X509_V_ERR_HOSTNAME_MISMATCH
# What etcd answers when it no longer knows our token (expired, or the auth store changed),
# or when auth was enabled after we found it off.
_STALE_TOKEN = ("invalid auth token", "auth store is old", "user name is empty")
_PASSWORD_HINT = "check --etcd-user and the password in UNBROKEN_ETCD_PASSWORD"


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


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle connection after 2 s, every 1 s, 3 times: a peer that vanished without
    a word (a cut link) ends the connection in about 5 s instead of never."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class EtcdGateway:
    """A client of etcd's v3 JSON gateway at `endpoints`: `call(path, body)` is one POST, its
    JSON reply, or StoreMisconfigured (a setting is wrong: one line naming the flag) or
    StoreUnavailable (no endpoint answers). No key space: callers encode their own keys.

    `cacert`, `cert` and `key` are PEM file paths for TLS (see the module's docstring);
    `user` and `password` log in to etcd when its authentication is enabled. Bad TLS files
    raise StoreMisconfigured here; everything else is found on the first call. Each thread
    keeps its own connections alive."""

    def __init__(self, endpoints: list[str], timeout: float = 5.0, *,
                 cacert: str | None = None, cert: str | None = None, key: str | None = None,
                 user: str | None = None, password: str | None = None) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        scheme = "https" if cacert or cert else "http"
        self.endpoints = [e if "://" in e else f"{scheme}://{e}" for e in endpoints]
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

    def settings(self) -> dict[str, str | None]:
        """The TLS files and the credentials, as keywords: what builds another client of the
        same cluster as the same user (with its own connections and its own token)."""
        return {**self._files, "user": self.user, "password": self._password}

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
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

    def stream(self, path: str, body: bytes) -> tuple[http.client.HTTPConnection, Any]:
        """POST `body` on a connection of its own and return it with its response, whose
        lines the caller reads as they come (a watch). The connection has no read timeout;
        TCP keepalive ends it within about 5 s of its peer vanishing. StoreUnavailable if
        no endpoint answers or etcd refuses."""
        if self.user is not None and self._token is None:
            self._authenticate()
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        errors = []
        for endpoint in self.endpoints:
            url = urllib.parse.urlsplit(endpoint)
            if url.scheme == "https":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    url.hostname, url.port, timeout=self.timeout, context=self._tls)
            else:
                conn = http.client.HTTPConnection(url.hostname, url.port, timeout=self.timeout)
            try:
                conn.connect()
                _keepalive(conn.sock)
                conn.request("POST", f"/v3/{path}", body=body, headers=headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                errors.append(f"{endpoint}: {_reason(exc)}")
                continue
            if response.status != 200:
                conn.close()
                errors.append(f"{endpoint}: HTTP {response.status}")
                continue
            conn.sock.settimeout(None)  # an idle watch is silent for as long as nothing changes
            return conn, response
        raise StoreUnavailable(f"cannot watch {self.describe()} ({'; '.join(errors)})")

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
