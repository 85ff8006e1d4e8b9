"""The simulation's answer in one sentence, for a manager: what the job loses today to
checkpoints and to failures, and what unbroken changes of each (pure)."""

from __future__ import annotations

from typing import Any

from unbroken.simulate.inputs import CheckpointMode, Job, Scale, Strategy
from unbroken.telemetry.categories import Category

NEGLIGIBLE = 0.001
"""A share of the wall time below this (0.1 %) is said as "less than 0.1 %"."""


def shares(result: dict[str, Any], strategy: Strategy, horizon_s: float) -> tuple[float, float]:
    """(checkpoints, failures): the strategy's share of the wall time lost to checkpoint
    stalls, and to everything else a failure costs (recovery, redone work, lost capacity,
    stragglers)."""
    badput = result[strategy.value]["badput_s"]
    checkpoints = badput[Category.CHECKPOINT_SAVE.value] / horizon_s
    failures = sum(v for k, v in badput.items() if k != Category.CHECKPOINT_SAVE.value) / horizon_s
    return checkpoints, failures


def _pct(x: float) -> str:
    return "less than 0.1 %" if x < NEGLIGIBLE else f"{100 * x:.1f} %"


def verdict(result: dict[str, Any], job: Job) -> str:
    """"At 64 GPUs for 30 days, you lose 11.2 % to synchronous checkpoints and 0.4 % to
    failures; asynchronous checkpoints bring the first to 0.1 %; in-place recovery changes
    the second by less than 0.1 %: at this scale, checkpoints are what matter." Today is the
    restart-style arm; unbroken, the in-place arm (no reserved capacity)."""
    h = job.horizon_s
    ck_today, fail_today = shares(result, Strategy.TORCHRUN, h)
    ck_ours, fail_ours = shares(result, Strategy.IN_PLACE, h)
    how = {CheckpointMode.SYNC: "synchronous checkpoints",
           CheckpointMode.ASYNC: "asynchronous checkpoints"}.get(job.checkpoint, "checkpoints")
    days = f"{job.days:g} day" + ("" if job.days == 1 else "s")
    text = (f"At {job.gpus:,} GPUs for {days}, you lose {_pct(ck_today)} to {how} and "
            f"{_pct(fail_today)} to failures")
    if job.checkpoint == CheckpointMode.SYNC:
        text += f"; asynchronous checkpoints bring the first to {_pct(ck_ours)}"
    if abs(fail_ours - fail_today) < NEGLIGIBLE:
        text += "; in-place recovery changes the second by less than 0.1 %"
    else:
        text += f"; in-place recovery brings the second to {_pct(fail_ours)}"
    gain_ck, gain_fail = ck_today - ck_ours, fail_today - fail_ours
    if max(gain_ck, gain_fail) < NEGLIGIBLE:
        what = "neither costs enough to matter"
    elif gain_ck > gain_fail:
        what = "checkpoints are what matter"
    else:
        what = "failures are what matter"
    return f"{text}: at this scale, {what}."


def stall_source(job: Job, scale: Scale) -> str:
    """Where the asynchronous checkpoint's stall comes from: never this machine's CPU
    figure presented as a GPU's."""
    stall = scale.checkpoint_stall_s(job)
    model = job.state_gb_per_gpu / job.host_copy_gbps
    if stall > model:
        return (f"asynchronous checkpoint stall: {stall:.3g} s a save, as --from-run measured "
                f"it (on that run's hardware: a CPU run's figure is not a GPU's)")
    return (f"asynchronous checkpoint stall: {stall:.3g} s a save, modelled: "
            f"{job.state_gb_per_gpu:g} GB a GPU copied to host memory at "
            f"{job.host_copy_gbps:g} GB/s (not measured on a GPU; docs/simulate.md)")
