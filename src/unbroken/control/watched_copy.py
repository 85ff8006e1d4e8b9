"""The copy of the watched keys and the revisions that say how current it is. Pure: no I/O,
no threads, no clock; `etcd_watch.Mirror` feeds it what etcd says and holds its lock.

The invariant (docs/design-notes.md, "Watches"): **the copy says it is live only when it
holds every write to a watched key at or below a revision read after its stream was opened**,
and every later write reaches it on a watch. What breaks it, and how it is kept:

- A watch created at a start revision in the past is *unsynced* in etcd: its confirmation
  (`created`) comes at once, its missed events up to 100 ms later. So a confirmation never
  means "caught up". Each confirmation carries etcd's current revision; if any of a stream's
  confirmations is past the copy's last full read, something was written that a watch
  may still owe, and the copy reads every watched key once more (at a revision at or past
  every confirmation) before it says live. A stream whose confirmations are all at or below
  the last full read (`loaded`) was created synced, right after it: the copy is live at
  once (the quiet reopen, the common one, costs no read).
- Only a full read says the copy is complete: events say so of their own watch alone (a
  stream that confirmed some watches delivers those watches' events; a watch that etcd
  found slow to take its events is sent them later, after other watches' newer ones).
- A stream starts right after the newest revision the copy has seen. If that is past the
  last full read, the stream's confirmations are too, and it reads again: what a watch of
  an earlier stream may have missed is in that read, never replayed (nor lost to a
  compaction of the revisions between). A copy that has no read yet, or must read again
  (etcd compacted its start away), starts its watches at etcd's present revision and reads
  once they are confirmed: one read, never two.
- Events at or below the last full read are already in it (a watch catching up re-delivers
  them): they are skipped, so the copy never steps back to an older value.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Kv:
    """A mirrored key: its value and etcd's revisions of it."""

    value: bytes
    create_revision: int
    mod_revision: int


@dataclass(frozen=True)
class Change:
    """One event of a watch: `kv` set at `revision` (None: the key was deleted)."""

    key: str
    revision: int
    kv: Kv | None


class KeyOrder:
    """The mirrored keys in sorted order, so that the keys under a prefix are found by
    bisection, not by a scan of every key (a leader at 2,048 agents mirrors some 10,000
    keys, and reads several queues at every look). Pure; not thread-safe on its own."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = sorted(keys)

    def add(self, key: str) -> None:
        """Note `key` (already noted: nothing)."""
        i = bisect.bisect_left(self._keys, key)
        if i == len(self._keys) or self._keys[i] != key:
            self._keys.insert(i, key)

    def remove(self, key: str) -> None:
        i = bisect.bisect_left(self._keys, key)
        if i < len(self._keys) and self._keys[i] == key:
            del self._keys[i]

    def under(self, prefix: str) -> list[str]:
        """The keys that start with `prefix`, in order."""
        i = bisect.bisect_left(self._keys, prefix)
        out = []
        while i < len(self._keys) and self._keys[i].startswith(prefix):
            out.append(self._keys[i])
            i += 1
        return out


class WatchedCopy:
    """The keys of `watches` watches and their revisions.

    The sequence, for each stream (the executor's, in `Mirror`): `open()` gives the start
    revision; `confirm()` once per confirmed watch; `apply()` for each batch of events;
    `load()` for every full read, the first one and the one `confirm` may ask for. `live` is
    true from the confirmation (or read) that completes the stream until the next `open()`
    or `drop()`."""

    def __init__(self, watches: int) -> None:
        if watches < 1:
            raise ValueError("a copy needs at least one watch")
        self.watches = watches
        self.kvs: dict[str, Kv] = {}
        self.order = KeyOrder()
        self.loaded = 0  # the last full read's revision: every watched write up to it is here
        self.seen = 0  # the newest revision etcd has shown the copy (reads, confirmations, events)
        self.revision = 0  # the newest revision the copy reflects (a read's or an event's)
        self.version = 0  # grows with every change of the copy
        self.live = False
        self._unread = True  # no full read yet, or one is owed (`forget`)
        self._confirmed: set[int] = set()
        self._past = False  # a confirmation of this stream came after a write the copy may lack

    def load(self, kvs: dict[str, Kv], revision: int) -> None:
        """A full read of every watched key at `revision`, which replaces the copy. It is live
        if the stream is whole (the read a stream's confirmations asked for)."""
        self.kvs, self.order = kvs, KeyOrder(kvs)
        self.loaded = self.revision = revision
        self.seen = max(self.seen, revision)
        self.version += 1
        self._past = self._unread = False
        self.live = len(self._confirmed) == self.watches

    def open(self) -> int | None:
        """A stream is about to be opened: the copy is not live; its watches start at the
        returned revision, the one after the newest the copy has seen (None: at etcd's
        present one, for a copy that must read once they are confirmed)."""
        self.live = False
        self._confirmed = set()
        self._past = self._unread
        return None if self._unread else self.seen + 1

    def forget(self) -> None:
        """etcd compacted away the revision a stream started at: the copy must read every
        watched key again, after its next stream's confirmations."""
        self.drop()
        self._unread = True

    def drop(self) -> None:
        """The stream broke: the copy is not live until a stream is whole again."""
        self.live = False
        self._confirmed = set()

    def confirm(self, watch: int, revision: int) -> bool:
        """etcd confirmed `watch` (0-based) at its current `revision`. True when the copy
        must now read every watched key before it is live (`load`): the stream is whole,
        but some confirmation came after a write a watch may still owe."""
        if not 0 <= watch < self.watches:
            raise ValueError(f"watch {watch} is not one of this copy's {self.watches}")
        self._confirmed.add(watch)
        self.seen = max(self.seen, revision)
        self._past = self._past or revision > self.loaded
        if len(self._confirmed) < self.watches:
            return False
        if self._past:
            return True
        self.live = True  # every watch was created synced, right after the last full read
        return False

    def apply(self, changes: Iterable[Change], revision: int = 0) -> bool:
        """A batch of one watch's events, in order, with its header's `revision`. Events at
        or below the last full read are already in the copy and are skipped. True when the
        copy changed."""
        changed = False
        for change in changes:
            if change.revision <= self.loaded:
                continue
            if change.kv is None:
                if self.kvs.pop(change.key, None) is not None:
                    self.order.remove(change.key)
            else:
                if change.key not in self.kvs:
                    self.order.add(change.key)
                self.kvs[change.key] = change.kv
            self.revision = max(self.revision, change.revision)
            changed = True
        self.seen = max(self.seen, revision, self.revision)
        if changed:
            self.version += 1
        return changed

    def get(self, key: str) -> Kv | None:
        return self.kvs.get(key)

    def under(self, prefix: str) -> dict[str, Kv]:
        return {k: self.kvs[k] for k in self.order.under(prefix)}
