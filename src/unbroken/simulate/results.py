"""A simulation's results as plain data: per strategy, ETTR with its confidence interval and
badput by category, at one scale or over a sweep of scales. What the table, the JSON, the
plot and the page show is built from these dicts (`simulate/output.py`)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from unbroken.simulate.draws import draw
from unbroken.simulate.engine import CHARGED, Checkpoints, Outcome, simulate
from unbroken.simulate.inputs import SENSITIVE, Failures, Job, Kind, Scale, Strategy
from unbroken.telemetry.categories import Category

SWEEP_GPUS = tuple(8 * 2 ** i for i in range(15))
"""8 to 131,072 GPUs, doubling."""


_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
         10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 60: 2.00}
"""Student's t, 97.5 % quantile, by degrees of freedom (a df between two rows takes the
smaller df's value: slightly wider)."""


def ci95(values: np.ndarray) -> list[float]:
    """The 95 % confidence interval of the mean over seeds (Student's t; 1.96 past 60)."""
    mean = float(values.mean())
    n = len(values)
    t = 1.96 if n - 1 > 60 else _T975[max(d for d in _T975 if d <= max(n - 1, 1))]
    half = t * float(values.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    return [round(mean - half, 5), round(mean + half, 5)]


def summary(out: Outcome) -> dict[str, Any]:
    """One strategy's result: ETTR (mean over seeds, and its 95 % CI), badput by category
    (mean seconds of the job's wall time), failures met (mean)."""
    return {
        "ettr": round(float(out.ettr.mean()), 5),
        "ettr_ci": ci95(out.ettr),
        "badput_s": {c.value: round(float(out.seconds[c].mean()), 1)
                     for c in CHARGED if c != Category.PRODUCTIVE_STEP},
        "failures": round(float(out.failures.mean()), 1),
    }


def costs_at(job: Job, scale: Scale, failures: Failures) -> dict[str, float]:
    """The recovery costs the model uses at the job's scale, in seconds."""
    ck = Checkpoints.for_strategy(job, scale, failures, Strategy.IN_PLACE)
    today = Checkpoints.for_strategy(job, scale, failures, Strategy.TORCHRUN)
    mine = {} if today == ck else {"today_checkpoint_every_s": round(today.every_s, 1),
                                   "today_checkpoint_stall_s": round(today.stall_s, 3)}
    return mine | {
        "job_mttf_h": round(failures.job_mttf_s(job.gpus) / 3600, 3),
        "restart_s": round(scale.restart_s(job), 1),
        "switch_s": round(scale.switch_s(job), 2),
        "spare_s": round(scale.spare_s(job), 2),
        "detect_crash_s": round(scale.detect_s(Kind.CRASH, job), 2),
        "detect_hang_s": round(scale.detect_s(Kind.HANG, job), 2),
        "detect_node_s": round(scale.detect_s(Kind.NODE_LOST, job), 2),
        "node_replace_s": round(scale.node_replace_s(job), 1),
        "checkpoint_every_s": round(ck.every_s, 1),
        "checkpoint_stall_s": round(ck.stall_s, 3),
        "checkpoint_persist_s": round(ck.persist_s, 2),
    }


def at_scale(failures: Failures, job: Job, scale: Scale, seeds: int,
             seed: int = 0) -> dict[str, Any]:
    """Every strategy on the same draws at the job's scale."""
    draws = draw(failures, job, seeds, seed)
    result: dict[str, Any] = {"gpus": job.gpus, "costs": costs_at(job, scale, failures)}
    for strategy in Strategy:
        result[strategy.value] = summary(simulate(draws, job, failures, scale, strategy))
    return result


def sweep(failures: Failures, job: Job, scale: Scale, seeds: int, seed: int = 0,
          gpus: tuple[int, ...] = SWEEP_GPUS) -> list[dict[str, Any]]:
    """`at_scale` for each GPU count (nodes of `job.gpus_per_node`)."""
    return [at_scale(failures, replace(job, gpus=n), scale, seeds, seed) for n in gpus]


def sensitivity(failures: Failures, job: Job, scale: Scale, seeds: int,
                seed: int = 0) -> list[dict[str, Any]]:
    """Each strategy's ETTR with one cost halved and doubled, the others as they are, on
    the same draws: how much the answer rests on each cost."""
    draws = draw(failures, job, seeds, seed)
    base = {s.value: float(simulate(draws, job, failures, scale, s).ettr.mean())
            for s in Strategy}
    rows = []
    for name in SENSITIVE:
        for factor in (0.5, 2.0):
            varied = replace(scale, factor={name: factor})
            row: dict[str, Any] = {"cost": name, "factor": factor}
            for s in Strategy:
                ettr = float(simulate(draws, job, failures, varied, s).ettr.mean())
                row[s.value] = round(ettr, 5)
                row[f"{s.value}_delta"] = round(ettr - base[s.value], 5)
            rows.append(row)
    return rows
