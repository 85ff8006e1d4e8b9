"""Typed reads and writes of the schema's keys over a backend.

The one place where messages become store values, where queues are appended to, and where
a notifying write bumps the attempt's news counter (after the write, so that the planner
woken by it finds what it was woken for).
"""

from __future__ import annotations

from typing import TypeVar

from unbroken.control.backend import Backend
from unbroken.control.codec import decode, encode
from unbroken.control.schema import Counter, Queue, Slot

T = TypeVar("T")


class Channel:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def read(self, slot: Slot[T]) -> T | None:
        raw = self.backend.get(slot.key)
        return None if raw is None else decode(slot.type, raw)

    def write(self, slot: Slot[T], message: T) -> None:
        self.backend.set(slot.key, encode(message))

    def first(self, slot: Slot[T], message: T) -> T:
        """Write `message` unless the slot is set already; return the message that won."""
        return decode(slot.type, self.backend.compare_set(slot.key, None, encode(message)))

    def count(self, counter: Counter) -> int:
        return self.backend.add(counter.key, 0)

    def bump(self, counter: Counter, amount: int = 1) -> int:
        value = self.backend.add(counter.key, amount)
        if counter.notifies:
            self.backend.add(counter.notifies, 1)
        return value

    def append(self, queue: Queue[T], message: T) -> int:
        """Add an entry; returns its index."""
        index = self.backend.add(queue.count.key, 1) - 1
        self.backend.set(queue.entry(index).key, encode(message))
        if queue.notifies:
            self.backend.add(queue.notifies, 1)
        return index

    def entries(self, queue: Queue[T], start: int) -> list[T]:
        """Entries from `start` on, up to the first counted but not yet written."""
        found = []
        for index in range(start, self.count(queue.count)):
            entry = self.read(queue.entry(index))
            if entry is None:
                break
            found.append(entry)
        return found
