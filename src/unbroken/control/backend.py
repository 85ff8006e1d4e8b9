"""What a control store must do. The embedded TCPStore (`tcp`) is the first backend; an etcd
v3 backend implements the same protocol, so no caller changes with it.

Keys given to a backend are relative to the run (`schema`); the backend adds the run's
prefix. Every call either succeeds or raises `StoreUnavailable`, which says where the store
was and what to check.
"""

from __future__ import annotations

from typing import Protocol

from torch.distributed import Store

from unbroken.errors import ControlPlaneError, ExitCode


class StoreUnavailable(ControlPlaneError):
    """The control store cannot be reached (its host gone, or the network)."""


class StoreMisconfigured(StoreUnavailable):
    """The control store refuses this client for good (a TLS mismatch, a certificate that
    cannot be loaded, a wrong etcd user or password): permanent, exit 2, never retried."""

    exit_code = ExitCode.USAGE


class Backend(Protocol):
    """A strongly consistent key-value store shared by every agent and worker of a run."""

    def get(self, key: str) -> str | None:
        """The value of `key`, or None if unset. Never blocks."""

    def get_many(self, keys: list[str]) -> list[str | None]:
        """The values of many keys (None where unset), in as few round trips as the store
        allows: how the leader reads every agent's lease at once."""

    def set(self, key: str, value: str) -> None: ...

    def delete_prefix(self) -> None:
        """Delete every key of the run: the leader clears a finished run's keys."""

    def compare_set(self, key: str, expected: str | None, desired: str) -> str:
        """Set `key` to `desired` if its value is `expected` (None: unset); return the value it
        holds afterwards, so the caller sees whether it won."""

    def add(self, key: str, amount: int) -> int:
        """Add to an integer key (created at 0) atomically; return the new value (each
        concurrent adder a different one: queue indexes and one-time claims rely on it)."""

    def increment(self, key: str) -> None:
        """Add one, without learning the value: as cheap as the store allows (a counter
        that only wakes its readers, who read it with `add(key, 0)`)."""

    def wait(self, keys: list[str], timeout: float) -> bool:
        """Block until every key is set; False after `timeout` seconds."""

    def refresh_lease(self, key: str) -> None:
        """The lease holder proves it is alive (called at least every lease period / 3)."""

    def lease_token(self, key: str) -> int:
        """A value that changes whenever the lease is refreshed; an observer that sees it
        unchanged for the lease period declares the holder lost (`lease.LeaseWatch`)."""

    def rendezvous_store(self, prefix: str, timeout: float) -> Store:
        """A c10d store for a process group's rendezvous under `prefix`, over a connection of
        its own (a rendezvous that timed out can leave a connection out of step)."""

    def describe(self) -> str:
        """Where the store is, for error messages."""
