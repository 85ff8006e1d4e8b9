"""The agent's side of posted departures: gather this node's workers' departures of one
generation into one `NodeDepartures` append (the worker's side: `control/departure_post.py`).

`DepartureGather` decides (pure): a generation's departures go out together once every
worker of this node still in that generation has posted one, or `window` seconds after the
first, whichever comes first. Waiting costs the recovery nothing in the first case (the
planner waits for every live member's departure anyway), and the window bounds it when a
worker here never leaves (stopped, or about to be declared dead). `DepartureRelay` does the
I/O: the socket, drained without blocking at each of the agent's looks.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.control.departure_post import decode
from unbroken.control.messages import Departure

GATHER_WINDOW = 0.2
"""Seconds at most that a generation's departures wait for the rest of this node's members.
The planner waits for every live member's departure anyway, so a member here that has not
left (stopped: it is killed, then it is dead and not waited for) delays no plan; the bound
is for a case not foreseen. Watchdogs that abort on notice look every 50 ms; 0.2 s leaves a
loaded host room for its slowest worker."""


@dataclass
class Batch:
    """Departures of one attempt's generation, gathered here, ready for one append."""

    attempt: int
    gen: int
    departures: list[Departure]
    since: float  # when the first of them was posted (the caller's clock)

    @property
    def wids(self) -> list[str]:
        return [d.wid for d in self.departures]


@dataclass
class _Pending:
    since: float
    departures: dict[str, Departure] = field(default_factory=dict)  # by wid: twice is once


class DepartureGather:
    """Which posted departures to send now (pure: the caller says when and who is in)."""

    def __init__(self, window: float = GATHER_WINDOW) -> None:
        self.window = window
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._sent: dict[tuple[int, int], set[str]] = {}

    def offer(self, attempt: int, departure: Departure, now: float) -> None:
        pending = self._pending.setdefault((attempt, departure.gen), _Pending(now))
        pending.departures[departure.wid] = departure

    def due_in(self, now: float) -> float | None:
        """Seconds until the oldest pending batch's window closes; None: nothing pending."""
        if not self._pending:
            return None
        return max(0.0, min(p.since for p in self._pending.values()) + self.window - now)

    def take(self, members_in: Callable[[int], set[str]], now: float) -> list[Batch]:
        """The batches to send now. `members_in(gen)`: the wids of this node's live
        workers that are in `gen`; a batch goes once all of them have departed (here or
        in a batch sent before), or once its window has closed."""
        ready = []
        for (attempt, gen), pending in list(self._pending.items()):
            sent = self._sent.setdefault((attempt, gen), set())
            gone = sent | pending.departures.keys()
            if members_in(gen) <= gone or now - pending.since >= self.window:
                del self._pending[(attempt, gen)]
                sent.update(pending.departures)
                ready.append(Batch(attempt, gen, list(pending.departures.values()),
                                   pending.since))
        newest = max((attempt for attempt, _ in self._sent), default=0)
        for key in [k for k in self._sent if k[0] < newest]:
            del self._sent[key]  # an older attempt's: its generations are over
        return ready


class DepartureRelay:
    """The socket this node's workers post their departures to, and their gathering."""

    def __init__(self, directory: Path, window: float = GATHER_WINDOW) -> None:
        self._dir = directory
        self.path = str(directory / "departures")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setblocking(False)
            self._sock.bind(self.path)
        except OSError:
            self._sock.close()
            raise
        self.gather = DepartureGather(window)
        self.rejected = 0  # datagrams that were not departures

    @classmethod
    def open(cls, window: float = GATHER_WINDOW) -> DepartureRelay | None:
        """A relay on a socket in a fresh directory only this user can enter; None where
        none can be made (no writable temporary directory, or its path too long for a
        socket): this node's workers then write their own departures."""
        try:
            directory = Path(tempfile.mkdtemp(prefix="unbroken-"))  # mode 0700
        except OSError:
            return None
        try:
            return cls(directory, window)
        except OSError:  # bind refuses a path longer than a socket's (107 bytes)
            shutil.rmtree(directory, ignore_errors=True)
            return None

    def fileno(self) -> int:
        return self._sock.fileno()

    def receive(self, now: float) -> int:
        """Take in every departure posted since the last look; how many there were."""
        n = 0
        while True:
            try:
                data = self._sock.recv(1 << 17)
            except BlockingIOError:
                return n
            posted = decode(data)
            if posted is None:
                self.rejected += 1
                continue
            self.gather.offer(posted.attempt, posted.departure, now)
            n += 1

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)
