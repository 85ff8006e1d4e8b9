"""Capacity planning: how many spare GPUs and standby nodes to pay for, and how often to
checkpoint, from the same simulation.

Reserve capacity costs its GPU-hours whether or not it is used; failures cost the GPU-hours
the job wastes (1 - ETTR of every training GPU). `plan_spares` simulates each candidate
(spare GPUs per node x standby nodes) on the same failure draws and picks the cheapest in
all, or, given a target ETTR, the one that reaches it with the fewest reserved GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from unbroken.simulate.draws import draw
from unbroken.simulate.engine import simulate
from unbroken.simulate.inputs import Failures, Job, Scale, Strategy

SPARES_PER_NODE = (0, 1, 2)
STANDBY_NODES = (0, 1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Option:
    """One candidate's reserve and what the job gets with it."""

    spares_per_node: int
    standby_nodes: int
    reserve_gpus: int
    ettr: float
    reserve_gpu_hours: float
    wasted_gpu_hours: float
    cost: float | None
    """(reserve + wasted GPU-hours) x the GPU-hour price; None without a price."""

    @property
    def gpu_hours(self) -> float:
        return self.reserve_gpu_hours + self.wasted_gpu_hours


@dataclass(frozen=True)
class SparesPlan:
    options: list[Option]
    chosen: Option | None
    why: str


def strategy_for(spares_per_node: int, standby_nodes: int) -> Strategy:
    if standby_nodes:
        return Strategy.SPARES_STANDBY
    return Strategy.SPARES if spares_per_node else Strategy.IN_PLACE


def plan_spares(failures: Failures, job: Job, scale: Scale, seeds: int,
                gpu_hour_cost: float | None = None,
                target_ettr: float | None = None, seed: int = 0) -> SparesPlan:
    """Every candidate reserve on common draws, and the choice: the fewest reserved GPUs
    reaching `target_ettr` if given, else the least GPU-hours in all (priced if a cost is
    given: the same choice, in money)."""
    draws = draw(failures, job, seeds, seed)
    hours = job.horizon_s / 3600.0
    options = []
    for spares in SPARES_PER_NODE:
        for standby in STANDBY_NODES:
            if spares >= job.gpus_per_node:
                continue  # spares are within the node: one must still train
            candidate = replace(job, spares_per_node=spares, standby_nodes=standby)
            out = simulate(draws, candidate, failures, scale, strategy_for(spares, standby))
            ettr = float(out.ettr.mean())
            reserve = candidate.reserved_gpus(strategy_for(spares, standby))
            wasted = (1.0 - ettr) * job.gpus * hours
            total = (reserve * hours + wasted)
            options.append(Option(spares, standby, reserve, ettr, reserve * hours, wasted,
                                  None if gpu_hour_cost is None else total * gpu_hour_cost))
    if target_ettr is not None:
        reaching = [o for o in options if o.ettr >= target_ettr]
        if not reaching:
            best = max(options, key=lambda o: o.ettr)
            return SparesPlan(options, None, f"no reserve reaches ETTR {target_ettr:.3f}: the "
                              f"best is {best.ettr:.4f} ({_name(best)})")
        chosen = min(reaching, key=lambda o: (o.reserve_gpus, -o.ettr))
        return SparesPlan(options, chosen, f"the fewest reserved GPUs reaching ETTR "
                          f"{target_ettr:.3f}: {_name(chosen)}, ETTR {chosen.ettr:.4f}")
    chosen = min(options, key=lambda o: (o.gpu_hours, o.reserve_gpus))
    money = f", {chosen.cost:,.0f} in all" if chosen.cost is not None else ""
    return SparesPlan(options, chosen, f"the least GPU-hours in all (reserve + wasted): "
                      f"{_name(chosen)}, {chosen.gpu_hours:,.0f} GPU-hours{money}")


def _name(o: Option) -> str:
    return f"{o.spares_per_node} spare GPU(s) per node and {o.standby_nodes} standby node(s)"
