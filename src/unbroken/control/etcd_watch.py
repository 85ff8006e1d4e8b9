"""A live local copy of the keys an agent reads, kept by etcd's v3 watch stream.

An agent looks at the control plane many times a second; with a mirror, a look at a watched
key costs no request at all, and a change is seen one round trip after it is written (the
watch event). An idle job costs etcd nothing but the agents' lease refreshes.

How it stays right (docs/design-notes.md, "Watches"; the bookkeeping is the pure
`watched_copy.WatchedCopy`):

- **Live means complete.** The copy says it is live only once every watch of its stream is
  confirmed *and* it holds every watched write up to a revision read after the stream was
  opened: a confirmation that shows a write since the copy's last full read makes it read
  every watched key again first (one txn), since a watch created in the past is confirmed
  before its missed events arrive.
- **Resumed, not replayed.** A broken stream is opened again from the newest revision seen
  + 1; the mirror is not live meanwhile, and reads go to etcd (where they fail or wait as
  any request does), so a frozen mirror never makes a lease look silent.
- **Compaction.** If etcd has compacted the revision to resume from, it cancels the watch
  (`compact_revision`); the mirror then reads every watched key again once its next stream
  is confirmed (counted in `resyncs`).
- **Read your writes.** A backend that wrote a watched key reads it from the mirror only once
  the mirror has reached that write's revision (`caught_up`).

The transport is the gateway's (`EtcdGateway.stream`): one HTTP POST to `/v3/watch` whose
body holds one create request per watched key or prefix, answered by a chunked stream of
JSON lines. The values are what etcd holds; nothing in them is executed.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from unbroken.control.backend import StoreUnavailable
from unbroken.control.etcd_gateway import EtcdGateway
from unbroken.control.schema import Watched
from unbroken.control.watched_copy import Change, KeyOrder, Kv, WatchedCopy

__all__ = ["CREATE_WAIT", "KeyOrder", "Kv", "Mirror", "prefix_end", "ranges"]

_RETRY_PAUSE = (0.05, 1.0)  # seconds between reconnects: first, and at most (doubling)
CREATE_WAIT = 1.0  # seconds for etcd to confirm a stream's next watch, else it is opened again


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def prefix_end(raw: bytes) -> bytes:
    """The first key past every key that starts with `raw` (etcd's `range_end`). Pure."""
    return raw[:-1] + bytes([raw[-1] + 1])


def ranges(run_prefix: str, watched: Iterable[Watched]) -> list[dict[str, str]]:
    """etcd's key / range_end pairs for `watched` under `run_prefix`. Pure."""
    out = []
    for w in watched:
        raw = (run_prefix + w.key).encode()
        out.append({"key": _b64(raw), **({"range_end": _b64(prefix_end(raw))} if w.prefix else {})})
    return out


class Mirror:
    """The watched keys of one run, kept current by a watch stream on a thread of its own.

    `get(key)` answers from the copy while it is live (None: unset; False: not covered, or
    not live: ask etcd); `version` grows with every change seen (and every re-read), and
    `wait_change` blocks until it does. `close()` ends the thread."""

    def __init__(self, gateway: EtcdGateway, run_prefix: str, watched: list[Watched]) -> None:
        self._gateway = gateway
        self._prefix = run_prefix
        self.watched = tuple(watched)
        self._exact = {w.key for w in watched if not w.prefix}
        self._prefixes = tuple(w.key for w in watched if w.prefix)
        self._copy = WatchedCopy(len(self.watched))
        self._cond = threading.Condition()
        self.resyncs = 0  # full re-reads after the resume revision was compacted away
        self.reads = 0  # full reads of every watched key: the first, after a compaction, after
        #                 a stream whose confirmations showed a write the copy may lack
        self.reconnects = 0
        self.last_error: str | None = None  # why the stream last broke
        self._closed = False
        self._conn: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="etcd-watch")
        self._thread.start()

    # ------------------------------------------------------------ what readers see
    @property
    def live(self) -> bool:
        """Every watch confirmed, and every watched write up to a revision read after the
        stream was opened held (watched_copy's invariant)."""
        return self._copy.live

    @property
    def revision(self) -> int:
        """The newest revision the copy reflects."""
        return self._copy.revision

    @property
    def version(self) -> int:
        """Grows at every change of the copy and every full read."""
        return self._copy.version

    def covers(self, key: str) -> bool:
        return key in self._exact or key.startswith(self._prefixes)

    def get(self, key: str, floor: int = 0) -> Kv | None | bool:
        """The mirrored kv of `key` (None: unset); False when the copy cannot answer (not
        covered, not live, or behind `floor`, the revision of the reader's own last write)."""
        if not self.covers(key) or not self.caught_up(floor):
            return False
        with self._cond:
            return self._copy.get(key)

    def under(self, prefix: str, floor: int = 0) -> dict[str, Kv] | bool:
        """Every mirrored key under `prefix` (which the mirror must cover whole); False as
        for `get`."""
        if not prefix.startswith(self._prefixes) or not self.caught_up(floor):
            return False
        with self._cond:
            return self._copy.under(prefix)

    def caught_up(self, floor: int, timeout: float = 0.5) -> bool:
        """Live, and at or past revision `floor` (waited for up to `timeout` seconds: the
        event of a write just made is a round trip away)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._copy.live and self._copy.revision < floor:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self._copy.live

    def wait_change(self, seen: int, timeout: float) -> int:
        """Block until `version` moves past `seen` (or `timeout` seconds); the version."""
        with self._cond:
            self._cond.wait_for(lambda: self._copy.version != seen or self._closed, timeout)
            return self._copy.version

    def close(self) -> None:
        """End the stream and the thread. The socket is shut down, not closed: the thread,
        which may be blocked reading it, wakes and closes the connection itself."""
        self._closed = True
        conn = self._conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._cond:
            self._copy.drop()
            self._cond.notify_all()

    # ------------------------------------------------------------ the stream
    def _run(self) -> None:
        pause = _RETRY_PAUSE[0]
        while not self._closed:
            try:
                self._follow()
                pause = _RETRY_PAUSE[0]
            except (StoreUnavailable, OSError, ValueError) as exc:
                self.last_error = str(exc)  # a blip: opened again from the last revision seen
            with self._cond:
                self._copy.drop()
                self._cond.notify_all()
            if self._closed:
                return
            self.reconnects += 1
            time.sleep(pause)
            pause = min(_RETRY_PAUSE[1], pause * 2)

    def _read_all(self) -> None:
        """Read every watched key at one revision: the copy is that read from then on."""
        reply = self._gateway.call("kv/txn", {
            "success": [{"request_range": r} for r in ranges(self._prefix, self.watched)]})
        kvs: dict[str, Kv] = {}
        for response in reply.get("responses", []):
            for kv in response.get("response_range", {}).get("kvs", []):
                kvs[self._relative(kv["key"])] = _kv(kv)
        with self._cond:
            self._copy.load(kvs, int(reply["header"]["revision"]))
            self.reads += 1
            self._cond.notify_all()

    def _follow(self) -> None:
        """Stream changes until the stream breaks (raises), etcd cancels it, or etcd has
        compacted its start away (returns; the copy reads everything at the next stream).

        etcd's gateway drops the rest of a request body once it starts its reply (Go's HTTP
        server discards unread body when a handler writes), so a stream may confirm only
        some of its watches. One that goes CREATE_WAIT without confirming its next watch
        (while the confirmed ones' events may keep it busy) is opened again: the copy is
        live only once every watch is confirmed and it has caught up (WatchedCopy)."""
        with self._cond:
            start = self._copy.open()
        since = {} if start is None else {"start_revision": str(start)}
        body = "\n".join(json.dumps({"create_request": {**r, **since, "watch_id": i}})
                         for i, r in enumerate(ranges(self._prefix, self.watched), start=1))
        conn, response = self._gateway.stream("watch", body.encode())  # watch_id 0: etcd picks
        self._conn = conn
        conn.sock.settimeout(CREATE_WAIT)
        deadline = time.monotonic() + CREATE_WAIT  # for the next confirmation, events or not
        try:
            created = 0
            while not self._closed:
                try:
                    line = response.readline()
                except TimeoutError:
                    line = None
                if line is None or (created < len(self.watched) and time.monotonic() > deadline):
                    # The confirmed watches' events may keep coming: a deadline for the
                    # next confirmation decides, not a silence (a loaded etcd confirms its
                    # watches one by one, each well within it).
                    raise StoreUnavailable(f"etcd confirmed {created} of {len(self.watched)} "
                                           f"watches, then none for {CREATE_WAIT:g}s")
                if not line:
                    raise StoreUnavailable("etcd closed the watch stream")
                result = json.loads(line).get("result")
                if result is None:  # an error object: the stream is over
                    raise StoreUnavailable(f"etcd ended the watch: {line[:200]!r}")
                if result.get("compact_revision") and result.get("canceled"):
                    self.resyncs += 1
                    with self._cond:
                        self._copy.forget()
                    return
                if result.get("canceled"):
                    raise StoreUnavailable(f"etcd cancelled a watch: {result.get('cancel_reason')}")
                header = int(result.get("header", {}).get("revision", 0))
                if result.get("created"):
                    created += 1
                    deadline = time.monotonic() + CREATE_WAIT
                    with self._cond:
                        must_read = self._copy.confirm(int(result.get("watch_id", 0)) - 1, header)
                    if must_read:
                        self._read_all()
                    if created == len(self.watched):
                        conn.sock.settimeout(None)  # silent for as long as nothing changes
                        with self._cond:
                            self._cond.notify_all()
                    continue
                self._apply(result.get("events", []), header)
        finally:
            self._conn = None
            conn.close()

    def _apply(self, events: list[dict[str, Any]], header: int) -> None:
        changes = [Change(key=self._relative(e["kv"]["key"]),
                          revision=int(e["kv"]["mod_revision"]),
                          kv=None if e.get("type") == "DELETE" else _kv(e["kv"]))
                   for e in events]
        with self._cond:
            if self._copy.apply(changes, header):
                self._cond.notify_all()

    def _relative(self, key_b64: str) -> str:
        return base64.b64decode(key_b64).decode()[len(self._prefix):]


def _kv(kv: dict[str, Any]) -> Kv:
    return Kv(value=base64.b64decode(kv.get("value", "")),
              create_revision=int(kv.get("create_revision", 0)),
              mod_revision=int(kv.get("mod_revision", 0)))
