"""The report's anomalies: what the detectors found and what it cost (a pure function of the
run's events, as `goodput.account` is).

- numerical anomalies: each finding's step, kind and cause, and the steps passed over;
- silent data corruption: the checks, their share of the step time (their own timers: the
  only figure below a noisy machine's noise), the mismatches and whom they blamed;
- stragglers: for each flag, the time the job lost to it before the remedy and after it.
  Every rank waits for a straggler in the all-reduce, so a step's excess over the steps
  before the onset is what it cost, on every rank (goodput's `straggler` category counts
  only single steps 3x the median: a rank 1.5x slow for 100 steps is this section's).
"""

from __future__ import annotations

import statistics
from typing import Any

BASELINE_STEPS = 50
"""Steps before a straggler's onset whose median is its baseline."""


def _steps(events: list[dict[str, Any]]) -> dict[int, float]:
    """Committed step -> its duration, as the lowest rank that committed it saw it (every
    rank waits for the slowest in the all-reduce: one rank's view is the job's pace)."""
    out: dict[int, tuple[int, float]] = {}
    for e in events:
        if e.get("event") == "step" and e.get("duration") is not None:
            rank = e.get("rank") or 0
            if e["step"] not in out or rank < out[e["step"]][0]:
                out[e["step"]] = (rank, e["duration"])
    return {step: d for step, (_, d) in out.items()}


def _straggler_costs(events: list[dict[str, Any]], steps: dict[int, float]) -> list[dict]:
    flags = [e for e in events if e.get("event") == "straggler_flagged"]
    remedies = [e for e in events if e.get("event") == "straggler_remedied"]
    switches = sorted(e["step"] for e in events if e.get("event") == "gen_switch")
    out = []
    for f in flags:
        onset = f["since_step"]
        base = [steps[s] for s in range(onset - BASELINE_STEPS, onset) if s in steps]
        if not base:
            continue
        median = statistics.median(base)
        drained = any(r["action"] == "drain" and r["straggler"] == f["straggler"]
                      and r["step"] >= f["step"] for r in remedies)
        fixed = next((s for s in switches if s >= f["step"]), None) if drained else None
        end = fixed if fixed is not None else max(steps, default=onset - 1) + 1
        before = sum(max(0.0, steps[s] - median) for s in range(onset, end) if s in steps)
        after_steps = [s for s in steps if fixed is not None and s >= fixed]
        after = sum(max(0.0, steps[s] - median) for s in after_steps)
        out.append({"slot": f["straggler"], "node": f.get("straggler_node"),
                    "since_step": onset, "flagged_step": f["step"], "ratio": f["ratio"],
                    "remedy": "drain" if drained else "report", "remedied_step": fixed,
                    "baseline_s": round(median, 6), "cost_before_s": round(before, 3),
                    "steps_before": end - onset, "cost_after_s": round(after, 3),
                    "steps_after": len(after_steps)})
    return out


def summarize(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the detectors found, or None when none ran."""
    if not any(e.get("event") == "anomaly_config" for e in events):
        return None
    steps = _steps(events)
    found = [{"step": e["step"], "kind": e["kind"], "cause": e["cause"]}
             for e in events if e.get("event") == "anomaly_classified"]
    skipped = sorted({e["step"] for e in events if e.get("event") == "step_skipped"})
    checks = [e for e in events if e.get("event") == "sdc_check"]
    check_s = sum(e["seconds"] for e in checks)
    mismatches = [{"step": e["step"], "blamed": e["blamed"], "resolution": e["resolution"]}
                  for e in events if e.get("event") == "sdc_mismatch"]
    stops = [e["report"] for e in events if e.get("event") == "anomaly_limit"]
    return {"numerics": found, "skipped": skipped, "stopped": stops[0] if stops else None,
            "sdc_checks": len(checks),
            "sdc_overhead_pct": round(100 * check_s / sum(steps.values()), 4)
            if checks and steps else None,
            "sdc_mismatches": mismatches,
            "stragglers": _straggler_costs(events, steps)}


def format_anomalies(summary: dict[str, Any] | None) -> str:
    """The section for the terminal; empty when no detector ran."""
    if summary is None:
        return ""
    lines = ["  anomalies"]
    for f in summary["numerics"]:
        lines.append(f"    step {f['step']}: {f['kind']} ({f['cause']})")
    if summary["skipped"]:
        lines.append(f"    steps passed over: {', '.join(map(str, summary['skipped']))}")
    if summary["stopped"]:
        lines.append(f"    stopped: {summary['stopped']}")
    if summary["sdc_checks"]:
        lines.append(f"    replica checks: {summary['sdc_checks']}, "
                     f"{summary['sdc_overhead_pct']:.3f}% of step time")
    for m in summary["sdc_mismatches"]:
        lines.append(f"    replicas disagreed at step {m['step']}: blamed slot(s) "
                     f"{m['blamed'] or '-'} ({m['resolution']})")
    for s in summary["stragglers"]:
        after = (f"; after the drain at step {s['remedied_step']}: {s['cost_after_s']:.2f}s "
                 f"over {s['steps_after']} steps" if s["remedied_step"] is not None else "")
        lines.append(f"    straggler slot {s['slot']} ({s['ratio']:.2f}x from step "
                     f"{s['since_step']}, flagged at {s['flagged_step']}): cost "
                     f"{s['cost_before_s']:.2f}s per rank over {s['steps_before']} steps{after}")
    return "\n".join(lines) if len(lines) > 1 else "  anomalies       none found"
