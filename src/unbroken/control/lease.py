"""Liveness by lease: a holder refreshes its lease; an observer declares it lost when the
lease has not moved for a timeout. The lease is a counter and the observer keeps the clock,
so the same code serves every backend, and no two hosts' clocks are ever compared.

With etcd the leases are read from the observer's watch (`etcd_watch.Mirror`): no request
per look, and a lease's token moves in the copy one round trip after its refresh. A copy
can lag or freeze unnoticed for a few seconds (a cut link before TCP keepalive ends the
stream), so a silence past `confirm_after` is read again from the store before it counts.

The observer's own pauses do not count against the holders: if the observer did not look
for longer than `pause_limit` (its host was stalled, or it rode out a blip of the control
plane), every clock starts again from its next look, so a paused leader does not declare
everyone lost.
"""

from __future__ import annotations

from unbroken.control.backend import Backend
from unbroken.control.schema import Counter


class LeaseWatch:
    """The observer's side: how long each watched lease has been silent."""

    def __init__(self, backend: Backend, pause_limit: float = 2.0,
                 confirm_after: float | None = None, every: float = 0.0) -> None:
        self.backend = backend
        self.pause_limit = pause_limit
        self.confirm_after = confirm_after  # a longer silence is read again, fresh
        self.every = every  # the leases are read at most this often; between, the clocks run
        self._seen: dict[str, tuple[int, float]] = {}  # key -> (token, when it last changed)
        self._last_look: float | None = None

    def silent_for(self, lease: Counter, now: float) -> float:
        """Seconds since the lease was last seen to move (0 the first time it is looked at)."""
        return self.silent_many([lease], now)[0]

    def silent_many(self, leases: list[Counter], now: float) -> list[float]:
        """`silent_for` of each lease, read in one call to the store."""
        if self._last_look is not None and now - self._last_look > self.pause_limit:
            self._seen.clear()  # we were away: nobody's silence can be judged across it
        elif self._last_look is not None and now - self._last_look < self.every \
                and all(lease.key in self._seen for lease in leases):
            return [now - self._seen[lease.key][1] for lease in leases]
        self._last_look = now
        raw = self.backend.get_many([lease.key for lease in leases])
        if self.confirm_after is not None:
            raw = self._confirmed(leases, raw, now)
        silent = []
        for lease, value in zip(leases, raw, strict=True):
            token = int(value or 0)
            last = self._seen.get(lease.key)
            if last is None or last[0] != token:
                self._seen[lease.key] = (token, now)
                silent.append(0.0)
            else:
                silent.append(now - last[1])
        return silent

    def _confirmed(self, leases: list[Counter], raw: list[str | None],
                   now: float) -> list[str | None]:
        """`raw`, with the leases silent past `confirm_after` read again from the store."""
        assert self.confirm_after is not None
        doubtful = [i for i, (lease, value) in enumerate(zip(leases, raw, strict=True))
                    if (last := self._seen.get(lease.key)) is not None
                    and last[0] == int(value or 0) and now - last[1] > self.confirm_after]
        if doubtful:
            fresh = self.backend.get_many([leases[i].key for i in doubtful], fresh=True)
            raw = list(raw)
            for i, value in zip(doubtful, fresh, strict=True):
                raw[i] = value
        return raw

    def reset(self) -> None:
        self._seen.clear()
        self._last_look = None
