"""A TCP proxy on loopback between a client and a store, which loses what a blip loses.

`drop_reply(pattern)`: the next request whose bytes contain `pattern` is forwarded to the
store, and its reply is thrown away and the connection closed, as when a link fails after
the request got through: the client cannot know whether its write was applied, and retries.
`cut()` closes every connection and refuses new ones until `mend()`: a partition.
`first_line_only(pattern)`: the next request whose bytes contain `pattern` is forwarded with
its body cut to its first line (its Content-Length to match), as when etcd's gateway drops
the rest of a watch request's body once it has replied: the stream confirms one watch only.
"""

from __future__ import annotations

import re
import socket
import threading


class Proxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pattern: bytes | None = None
        self._withhold: bytes | None = None
        self._conns: list[socket.socket] = []
        self._cut = False
        self.dropped = 0  # replies thrown away
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def drop_reply(self, pattern: bytes) -> None:
        with self._lock:
            self._pattern = pattern

    def first_line_only(self, pattern: bytes) -> None:
        with self._lock:
            self._withhold = pattern

    @property
    def withholding(self) -> bytes | None:
        """The pattern `first_line_only` waits for (None: that request has gone through)."""
        with self._lock:
            return self._withhold

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            conns, self._conns = self._conns, []
        for c in conns:
            _shut(c)

    def mend(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                cut = self._cut
            if cut:
                _shut(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _shut(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._conns += [client, server]
            armed = threading.Event()  # this connection's next reply is to be lost
            threading.Thread(target=self._requests, args=(client, server, armed), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, armed), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, armed: threading.Event) -> None:
        held: bytes | None = None  # a request being withheld: its bytes so far
        while data := _recv(client):
            with self._lock:
                if self._pattern is not None and self._pattern in data:
                    self._pattern = None
                    armed.set()
                if self._withhold is not None and self._withhold in data:
                    self._withhold = None
                    held = b""
            if held is not None:
                held += data
                head, end, body = held.partition(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                if not end or length is None or len(body) < int(length[1]):
                    continue  # not all of it has come yet
                first = body[:body.index(b"\n") + 1] if b"\n" in body else body
                data = head.replace(length[0], b"Content-Length: %d" % len(first)) + end + first
                held = None
            try:
                server.sendall(data)
            except OSError:
                break
        _shut(server)

    def _replies(self, server: socket.socket, client: socket.socket, armed: threading.Event) -> None:
        while data := _recv(server):
            if armed.is_set():
                self.dropped += 1
                break  # the reply is lost, and the link with it
            try:
                client.sendall(data)
            except OSError:
                break
        _shut(client)
        _shut(server)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
