"""Typed reads and writes of the schema's keys over a backend.

The one place where messages become store values, where queues are appended to, where a
notifying write bumps the attempt's news counter (after the write, so that the planner woken
by it finds what it was woken for; on etcd the write itself wakes its watchers), and where
messages are signed and checked (`signing`). A message that fails its check is reported
through `on_forged` and read as absent: nothing acts on it.

Every add and append gets a request id here, once, above the retrying layer: a retry is
the same request, and the store counts it once (docs/design-notes.md, "Request ids").
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TypeVar

from unbroken.control.backend import Backend
from unbroken.control.codec import decode, encode
from unbroken.control.schema import Counter, Queue, Slot
from unbroken.control.signing import ForgedMessage, Signer

T = TypeVar("T")


class Channel:
    def __init__(self, backend: Backend, signer: Signer | None = None,
                 on_forged: Callable[[str, str], None] | None = None) -> None:
        self.backend = backend
        self.signer = signer
        self.on_forged = on_forged or (lambda key, why: None)
        self._reported: set[tuple[str, str]] = set()

    def _seal(self, key: str, message: object) -> str:
        text = encode(message)
        return self.signer.seal(key, text) if self.signer is not None else text

    def _open(self, slot: Slot[T], raw: str) -> T | None:
        if self.signer is not None:
            try:
                raw = self.signer.open(slot.key, raw)
            except ForgedMessage as exc:
                if (slot.key, raw) not in self._reported:  # once per forged value
                    self._reported.add((slot.key, raw))
                    self.on_forged(slot.key, str(exc))
                return None
        return decode(slot.type, raw)

    def read(self, slot: Slot[T]) -> T | None:
        raw = self.backend.get(slot.key)
        return None if raw is None else self._open(slot, raw)

    def signed_elsewhere(self, slot: Slot[T]) -> bool:
        """The slot holds a value whose signature does not check: someone (typically the
        rest of the job, if this agent was given the wrong secret) signs with another key."""
        raw = self.backend.get(slot.key)
        return raw is not None and self._open(slot, raw) is None

    def read_many(self, slots: list[Slot[T]]) -> list[T | None]:
        """`read` of many slots in as few round trips as the backend allows."""
        raws = self.backend.get_many([slot.key for slot in slots])
        return [None if raw is None else self._open(slot, raw)
                for slot, raw in zip(slots, raws, strict=True)]

    def write(self, slot: Slot[T], message: T) -> None:
        self.backend.set(slot.key, self._seal(slot.key, message))

    def first(self, slot: Slot[T], message: T) -> T | None:
        """Write `message` unless the slot is set already; return the message that won.
        A forged value squatting the slot is reported and overwritten."""
        sealed = self._seal(slot.key, message)
        won = self._open(slot, self.backend.compare_set(slot.key, None, sealed))
        if won is None:
            self.backend.set(slot.key, sealed)
            return message
        return won

    def replace(self, slot: Slot[T], old: T, new: T) -> bool:
        """Write `new` only if the slot still holds `old` (as this channel would have sealed
        it): one winner among racing writers. True if this call won."""
        sealed = self._seal(slot.key, new)
        return self.backend.compare_set(slot.key, self._seal(slot.key, old), sealed) == sealed

    def count(self, counter: Counter) -> int:
        return self.backend.add(counter.key, 0)

    def news(self, counter: Counter) -> int:
        """What moves when there is news for the reader of `counter`: the watch's count of
        changes where the backend watches (no request), else the news counter itself."""
        changes = self.backend.changes()
        return self.count(counter) if changes is None else changes

    def fence_on(self, slot: Slot[T], message: T) -> None:
        """Every later write of this channel holds only while `slot` holds `message` as
        this channel sealed it (a leader's claim); else it raises `backend.Fenced`."""
        self.backend.fence(slot.key, self._seal(slot.key, message))

    def unfence(self) -> None:
        """Lift `fence_on`: this agent handed its lead over and goes on as a follower."""
        self.backend.fence(None, None)

    def bump(self, counter: Counter) -> None:
        """Add one; its readers read the count (`count`)."""
        self.backend.increment(counter.key, uuid.uuid4().hex)
        if counter.notifies:
            self.backend.notify(counter.notifies)

    def claim(self, counter: Counter) -> int:
        """Add one and learn which add this was (1: the first of all)."""
        value = self.backend.add(counter.key, 1, uuid.uuid4().hex)
        if counter.notifies:
            self.backend.notify(counter.notifies)
        return value

    def append(self, queue: Queue[T], message: T) -> str:
        """Add an entry, once however often the store is retried; returns its request id
        (`position` turns it into its index)."""
        rid = uuid.uuid4().hex
        self.backend.append(queue.key, rid, self._seal(queue.entry_key(rid), message))
        if queue.notifies:
            self.backend.notify(queue.notifies)
        return rid

    def position(self, queue: Queue[T], request_id: str) -> int:
        return self.backend.position(queue.key, request_id)

    def entries(self, queue: Queue[T], start: int) -> list[T | None]:
        """Entries from `start` on, in append order, up to the first not yet written. A
        forged entry, or a slot its writer abandoned, stands as None, so that the reader's
        cursor moves past it."""
        found: list[T | None] = []
        for rid, raw in self.backend.read_queue(queue.key, start):
            slot = Slot(queue.entry_key(rid or ""), queue.type, queue.writer)
            found.append(None if raw is None else self._open(slot, raw))
        return found
