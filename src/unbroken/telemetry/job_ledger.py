"""What only the leader can attribute: the capacity the job lost running short of ranks.

A node's series count its own ranks while it holds them (`node_metrics`); a rank that no
live node holds (its node died, and the job went on shrunk) is counted by no node. The
leader knows the job's full world and the world it runs: `CapacityLedger` integrates the
difference, rank-seconds, from the leader's own `rendezvous` and `gen_up` events. It is a
counter (`Metric.JOB_CAPACITY_LOST`) that a new leader resumes: the ledger is persisted in
the `LeaderRecord` whenever the number of missing ranks changes (`plain`, `from_plain`),
and a successor continues from it. Pure: the caller gives the times.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from unbroken.telemetry import schema as ev


@dataclass
class CapacityLedger:
    full: int = 0
    """The job's full world: the largest it ran at."""
    missing: int = 0
    """Ranks missing from the world it runs now."""
    since: float = 0.0
    """Wall time `missing` holds from (0: nothing folded yet)."""
    lost: float = 0.0
    """Rank-seconds lost before `since`."""
    gen: int = 0
    """The newest generation up."""

    def fold(self, e: ev.EventBody) -> None:
        """The leader's own `rendezvous` (an attempt's world) or `gen_up` (a generation's);
        one older than what the ledger already holds (a successor re-reading a shared log)
        changes nothing."""
        if isinstance(e, ev.Rendezvous | ev.GenUp) and e.world_size and e.t is not None \
                and e.t >= self.since:
            self.change(int(e.world_size), e.t)
            if isinstance(e, ev.GenUp):
                self.gen = max(self.gen, e.gen)

    def change(self, world: int, t: float) -> None:
        """The job runs `world` ranks from `t` on."""
        if self.since:
            self.lost += self.missing * max(0.0, t - self.since)
        self.full = max(self.full, world)
        self.missing, self.since = self.full - world, t

    def total(self, now: float) -> float:
        """Rank-seconds lost up to `now`."""
        return self.lost + self.missing * max(0.0, now - self.since) if self.since else 0.0

    def plain(self) -> dict[str, Any]:
        """For the `LeaderRecord`."""
        return asdict(self)

    @classmethod
    def from_plain(cls, plain: dict[str, Any] | None) -> CapacityLedger:
        return cls(**plain) if plain else cls()
