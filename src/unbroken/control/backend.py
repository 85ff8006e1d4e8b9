"""What a control store must do. The embedded TCPStore (`tcp`) is the first backend; an etcd
v3 backend implements the same protocol, so no caller changes with it.

Keys given to a backend are relative to the run (`schema`); the backend adds the run's
prefix. Every call either succeeds or raises `StoreUnavailable`, which says where the store
was and what to check.
"""

from __future__ import annotations

from typing import Protocol

from torch.distributed import Store

from unbroken.control.schema import Watched
from unbroken.errors import ControlPlaneError, ExitCode


class StoreUnavailable(ControlPlaneError):
    """The control store cannot be reached (its host gone, or the network)."""


class StoreMisconfigured(StoreUnavailable):
    """The control store refuses this client for good (a TLS mismatch, a certificate that
    cannot be loaded, a wrong etcd user or password): permanent, exit 2, never retried."""

    exit_code = ExitCode.USAGE


class Fenced(ControlPlaneError):
    """A fenced write was refused: the key it was fenced on (the leader's claim) no longer
    holds this agent's value, so another agent leads and this one must stand down."""


class Backend(Protocol):
    """A strongly consistent key-value store shared by every agent and worker of a run."""

    def get(self, key: str, fresh: bool = False) -> str | None:
        """The value of `key`, or None if unset. Never blocks. A watched key is read from the
        watch's copy unless `fresh` (a decision that must not rest on a copy)."""

    def get_many(self, keys: list[str], fresh: bool = False) -> list[str | None]:
        """The values of many keys (None where unset), in as few round trips as the store
        allows: how the leader reads every agent's lease at once."""

    def set(self, key: str, value: str) -> None: ...

    def delete_prefix(self) -> None:
        """Delete every key of the run: the leader clears a finished run's keys."""

    def compare_set(self, key: str, expected: str | None, desired: str) -> str:
        """Set `key` to `desired` if its value is `expected` (None: unset); return the value it
        holds afterwards, so the caller sees whether it won."""

    def add(self, key: str, amount: int, request_id: str | None = None) -> int:
        """Add to an integer key (created at 0) atomically; return the new value (each
        concurrent adder a different one: one-time claims rely on it). `request_id`, the
        same on every try of one add, makes a retry count once on etcd; the TCPStore has
        no way to recognise it (docs/design-notes.md, "Request ids")."""

    def increment(self, key: str, request_id: str | None = None) -> None:
        """Add one, without learning the value: as cheap as the store allows (a counter
        that only wakes its readers, who read it with `add(key, 0)`)."""

    def notify(self, key: str) -> None:
        """Bump the news counter `key`, for a reader that polls it; nothing where readers
        watch (etcd: the write that is the news wakes them)."""

    def append(self, queue: str, request_id: str, value: str) -> None:
        """Append `value` to `queue`, once however often it is retried under the same
        `request_id`, and never leaving a gap that would stall the queue's readers."""

    def read_queue(self, queue: str, start: int) -> list[tuple[str | None, str | None]]:
        """(request id, value) of the entries from index `start` on, in append order; (None,
        None) for a hole a writer abandoned, so that cursors move past it."""

    def position(self, queue: str, request_id: str) -> int:
        """The index of the entry appended under `request_id` (a writer that waits for an
        answer by index: drains)."""

    def watch(self, watched: list[Watched] | None) -> None:
        """Keep `watched` current locally, so that reading them costs no request (etcd's
        watch stream; None ends it); nothing on a backend that cannot watch."""


    def changes(self) -> int | None:
        """A number that moves whenever a watched key may have changed: None if this
        backend cannot watch (poll the news counter instead)."""

    def wait_change(self, seen: int | None, timeout: float) -> None:
        """Sleep until a watched key changes after `seen`, at most `timeout` seconds."""

    def fence(self, key: str | None, value: str | None) -> None:
        """Make every later write of this client hold only while `key` holds `value` (the
        leader's claim); a write that fails it raises `Fenced`. `key` None lifts it (the
        lead was handed over). Nothing on the TCPStore, whose host is the only leader."""

    def wait(self, keys: list[str], timeout: float) -> bool:
        """Block until every key is set; False after `timeout` seconds."""

    def refresh_lease(self, key: str) -> None:
        """The lease holder proves it is alive (called at least every lease period / 3)."""


    def rendezvous_store(self, prefix: str, timeout: float) -> Store:
        """A c10d store for a process group's rendezvous under `prefix`, over a connection of
        its own (a rendezvous that timed out can leave a connection out of step)."""

    def describe(self) -> str:
        """Where the store is, for error messages."""
