"""Recovery costs, and real fault rates, from the event logs of the user's own runs.

`measure(run_dirs)` reads each run's goodput report (`telemetry.report.build_report`) and
takes, as medians with their range over the sample:

- the in-place switch (`gen_up` durations of generations that recovered a fault), and a
  spare's (those that followed a `spare_promoted`);
- detection of a crash and of a lost node (`faults[].detection`; a hang's is mostly the
  run's own timeout, which the scale model sets from the step), and a full restart (a
  fault recovered by a restart: its rank-seconds of recovery per rank), which the scale
  model takes as a floor under the published restarts at scale;
- the checkpoint's stall and its time to durable.

Rates come only from faults that were not injected: an injected fault (the demo's, the
tests', `UNBROKEN_FAULTS`) shows what recovery costs, never how often real faults happen.
The rate per GPU-hour has an exact Poisson 95 % interval (Garwood), so that a handful of
faults says how little it knows.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from unbroken.errors import UserError
from unbroken.simulate.inputs import MEASURED, Measured

RECOVERY = ("infrastructure_recovery", "program_startup", "init_rendezvous",
            "checkpoint_restore", "idle")
"""What a full restart's downtime is made of, in a fault's `cost_s`."""


@dataclass(frozen=True)
class Spread:
    """A cost measured `n` times: its median and range."""

    median: float
    low: float
    high: float
    n: int


@dataclass(frozen=True)
class RunMeasures:
    runs: int
    gpu_hours: float
    real_faults: int
    injected_faults: int
    costs: dict[str, Spread] = field(default_factory=dict)
    """`Measured` field name -> what the runs showed."""
    gpu_mtbf_hours: tuple[float, float, float] | None = None
    """(estimate, low, high) from real faults; None when none was real."""
    workers: int = 0
    today: dict[str, Spread] = field(default_factory=dict)
    """A plain script's own checkpoints (`script_save`): `stall_s`, one save's time inside
    the call, and `every_s`, the time between saves: what `--checkpoint sync` describes."""

    def measured(self, bound: str = "median") -> Measured:
        """`Measured` with the runs' costs (`bound`: median, low or high) in place of ours."""
        values = {k: getattr(s, bound) for k, s in self.costs.items()}
        return replace(MEASURED, workers=self.workers or MEASURED.workers, **values)

    def describe(self) -> list[str]:
        lines = [f"from {self.runs} run(s): {self.gpu_hours:.3f} GPU-hours, "
                 f"{self.real_faults} real fault(s), {self.injected_faults} injected"]
        for k, s in self.costs.items():
            lines.append(f"  {k}: median {s.median:.3f} s (range {s.low:.3f}-{s.high:.3f}, "
                         f"n={s.n}), measured at {self.workers} workers")
        for k, s in self.today.items():
            lines.append(f"  the script's own checkpoints, {k}: median {s.median:.3f} s (range "
                         f"{s.low:.3f}-{s.high:.3f}, n={s.n}): --checkpoint sync")
        if self.gpu_mtbf_hours is None:
            why = ("no fault was real: injected faults give costs, never rates" if
                   self.injected_faults else "no fault happened")
            lines.append(f"  fault rate: not derived ({why}); the failure model's rate is used")
        else:
            est, lo, hi = self.gpu_mtbf_hours
            lines.append(f"  GPU MTBF from real faults: {est:,.0f} h (95 % {lo:,.0f}-"
                         f"{hi:,.0f} h)")
        return lines


def _spread(values: list[float]) -> Spread | None:
    values = [v for v in values if v is not None and math.isfinite(v) and v >= 0]
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


def _poisson_cdf(k: int, mu: float) -> float:
    """P(X <= k) for X ~ Poisson(mu)."""
    if k < 0:
        return 0.0
    if mu <= 0:
        return 1.0
    return min(1.0, sum(math.exp(i * math.log(mu) - mu - math.lgamma(i + 1))
                        for i in range(k + 1)))


def _solve_mu(k: int, target: float) -> float:
    """The mean mu with P(X <= k; mu) = target (decreasing in mu), by bisection."""
    lo, hi = 0.0, k + 20.0 * math.sqrt(k + 1) + 20.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _poisson_cdf(k, mid) > target else (lo, mid)
    return (lo + hi) / 2


def poisson_mtbf(count: int, exposure_h: float) -> tuple[float, float, float]:
    """MTBF estimate and its exact (Garwood) 95 % interval for `count` failures in
    `exposure_h` GPU-hours: the Poisson means whose tails hold 2.5 % at the count."""
    high_mu = _solve_mu(count, 0.025)
    low_mu = _solve_mu(count - 1, 0.975) if count else 0.0
    return (exposure_h / count if count else math.inf, exposure_h / high_mu,
            exposure_h / low_mu if low_mu else math.inf)


def _run_id(path: Path) -> str | None:
    """The job id (`agent_start.run_id`) of the run whose log is under `path` (or is
    `path`: a saved log)."""
    import json

    from unbroken.telemetry.event_copy import COPY_GLOB, EVENT_TAG

    logs = [path] if path.is_file() else [path / "events.jsonl",
                                          *sorted(path.glob("**/events.jsonl"))]
    if path.is_dir() and not logs[0].exists():
        logs += sorted(path.glob(COPY_GLOB))  # an --event-dir: every copy is of one job
    for log in logs:
        try:
            with open(log, encoding="utf-8") as fh:
                for _, line in zip(range(50), fh, strict=False):
                    if EVENT_TAG in line:  # a saved log's tagged line
                        line = line.split(EVENT_TAG, 1)[1]
                    elif path.is_file() and not line.startswith("{"):
                        continue
                    record = json.loads(line)
                    if record.get("event") == "agent_start":
                        return str(record.get("run_id"))
        except (OSError, ValueError, AttributeError):
            continue
    return None


def measure(run_dirs: list[str | Path]) -> RunMeasures:
    """What the runs in `run_dirs` measured. The dirs of one job's nodes (nodes that share
    nothing keep their own: the same `run_id`) are merged into one run, as `unbroken report
    DIR DIR` does; dirs of other jobs are other runs."""
    from unbroken.telemetry.event_copy import COPY_GLOB
    from unbroken.telemetry.report import build_report

    runs: dict[str, list[Path]] = {}
    for d in run_dirs:
        path = Path(d)
        if not (path / "events.jsonl").exists() and not any(path.glob("**/events.jsonl")) \
                and not any(path.glob(COPY_GLOB)) and not path.is_file():
            raise UserError(f"{d}: no event log (events.jsonl) here: is it the run dir of a "
                            "run (`unbroken run --run-dir`), its --event-dir, or a saved log?")
        runs.setdefault(_run_id(path) or str(path), []).append(path)
    reports = []
    for paths in runs.values():
        d = " ".join(map(str, paths))
        try:
            reports.append(build_report(paths))
        except (ValueError, TypeError, KeyError) as exc:
            raise UserError(f"{d}: its event log cannot be read as a run's ({exc}): is it "
                            "the run dir of a run (`unbroken run --run-dir`)?") from None
    return from_reports(reports)


def from_reports(reports: list[dict[str, Any]]) -> RunMeasures:
    """`measure` on goodput reports already built (pure)."""
    switch, spare, restart = [], [], []
    detect: dict[str, list[float]] = {"crash": [], "hang": [], "node_lost": []}
    stall, durable = [], []
    script_stall: list[float] = []
    script_every: list[float] = []
    real = injected = 0
    gpu_hours = 0.0
    workers = 0
    for r in reports:
        world = r.get("world_size") or 0
        workers = max(workers, world)
        gpu_hours += (r.get("wall_s") or 0.0) * world / 3600
        promoted = [s["t"] for s in r.get("spares", []) if s["event"] == "promoted"]
        for g in r.get("recoveries", []):
            if not g["faults"]:
                continue  # a planned grow-back
            began = g["t"] - g["duration"]
            used_spare = any(began - 1.0 <= t <= g["t"] for t in promoted)
            (spare if used_spare else switch).append(g["duration"])
        for f in r.get("faults", []):
            if f.get("injected"):
                injected += 1
            else:
                real += 1
            kind = "crash" if f["kind"] in ("crash", "exception") else f["kind"]
            if kind in detect:
                detect[kind].append(f["detection"])
            if not f["in_place"] and world:
                restart.append(sum(f["cost_s"].get(c, 0.0) for c in RECOVERY) / world)
        watched = r.get("watched") or {}
        script_stall += watched.get("save_s", [])
        script_every += watched.get("save_every_s", [])
        for c in r.get("checkpoints", []):
            if c["ok"]:
                stall.append(c["stall"])
                durable.append(c["durable"])
    found = {
        "switch_s": _spread(switch), "spare_s": _spread(spare),
        # (a hang's detection is left out: it is mostly the run's own hang timeout, which at
        # scale is 3 x the step, not what a small run's steps gave)
        "crash_detect_s": _spread(detect["crash"]),
        "node_detect_s": _spread(detect["node_lost"]), "full_restart_s": _spread(restart),
        "checkpoint_stall_s": _spread(stall), "checkpoint_durable_s": _spread(durable),
    }
    costs = {k: v for k, v in found.items() if v is not None}
    mtbf = poisson_mtbf(real, gpu_hours) if real and gpu_hours > 0 else None
    return RunMeasures(runs=len(reports), gpu_hours=gpu_hours, real_faults=real,
                       injected_faults=injected, costs=costs, gpu_mtbf_hours=mtbf,
                       workers=workers,
                       today={k: v for k, v in (("stall_s", _spread(script_stall)),
                                                ("every_s", _spread(script_every)))
                              if v is not None})
