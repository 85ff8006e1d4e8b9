"""The failure draws: when each failure happens, of what kind, on which node, per seed.

Drawn once per (seed set, scale) and shared by every strategy (common random numbers), so
strategies are compared on the same failures. Times are a renewal process: exponential
gaps (a Poisson process) or Weibull gaps of the same mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from unbroken.errors import UserError
from unbroken.simulate.inputs import Failures, Job, Kind

KINDS = tuple(Kind)
"""Kinds by index: `Draws.kind` holds indices into this tuple."""

MAX_FAILURES = 20_000_000
"""Failures over all seeds beyond which a simulation is refused (a rate mistyped by
orders of magnitude would otherwise run for hours); the default sweep's largest point draws
about 600,000."""


@dataclass(frozen=True)
class Draws:
    """Failures of `seeds` runs, padded: row s holds seed s's failures in time order, and
    `t` is +inf past its last one."""

    t: np.ndarray  # (seeds, F) seconds from the job's start
    kind: np.ndarray  # (seeds, F) index into KINDS
    node: np.ndarray  # (seeds, F) the node it hit

    @property
    def seeds(self) -> int:
        return self.t.shape[0]

    def count(self, horizon: float) -> np.ndarray:
        return (self.t < horizon).sum(axis=1)


def draw(failures: Failures, job: Job, seeds: int, seed: int = 0) -> Draws:
    """Failures over `job.days` at `job.gpus` GPUs for `seeds` runs, from `seed`."""
    rng = np.random.default_rng([seed, job.gpus])
    mttf = failures.job_mttf_s(job.gpus)
    horizon = job.horizon_s
    k = failures.weibull_shape
    scale = mttf / math.gamma(1.0 + 1.0 / k)  # the Weibull scale whose mean is the MTTF
    expected = horizon / mttf
    if expected * seeds > MAX_FAILURES:
        raise UserError(f"{expected:,.0f} failures per run (a job MTTF of {mttf:.3g} s at "
                        f"{job.gpus:,} GPUs) x {seeds} seeds is too many to simulate: is the "
                        "failure rate right?")
    width = max(8, int(expected + 8.0 * math.sqrt(expected) + 16))
    while True:
        gaps = scale * rng.weibull(k, size=(seeds, width)) if k != 1.0 else \
            rng.exponential(mttf, size=(seeds, width))
        t = np.cumsum(gaps, axis=1)
        if (t[:, -1] >= horizon).all():
            break
        width *= 2  # a rare seed with more failures than drawn: draw wider
    t[t >= horizon] = np.inf
    used = int((t < horizon).sum(axis=1).max()) if t.size else 0
    t = t[:, :max(used, 1)]
    shares = np.array([failures.shares.get(kind, 0.0) for kind in KINDS])
    kind = rng.choice(len(KINDS), size=t.shape, p=shares / shares.sum())
    node = rng.integers(0, job.nodes, size=t.shape)
    return Draws(t=t, kind=kind, node=node)
