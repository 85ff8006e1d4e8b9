"""Liveness by lease: a holder refreshes its lease; an observer declares it lost when the
lease has not moved for a timeout. With TCPStore the lease is a counter and the observer
keeps the clock; a backend with real leases (etcd) gives the same answer."""

from __future__ import annotations

from unbroken.control.backend import Backend
from unbroken.control.schema import Counter


class LeaseWatch:
    """The observer's side: how long each watched lease has been silent."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._seen: dict[str, tuple[int, float]] = {}  # key -> (token, when it last changed)

    def silent_for(self, lease: Counter, now: float) -> float:
        """Seconds since the lease was last seen to move (0 the first time it is looked at)."""
        token = self.backend.lease_token(lease.key)
        last = self._seen.get(lease.key)
        if last is None or last[0] != token:
            self._seen[lease.key] = (token, now)
            return 0.0
        return now - last[1]

    def reset(self) -> None:
        self._seen.clear()
