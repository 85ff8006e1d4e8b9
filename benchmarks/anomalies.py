"""The anomaly detectors (issue 27): how soon each finds what it is for, what it costs a step,
and whether a clean run with jitter trips any of them; every arm in one run.

Each arm is one job of the example GPT (tiny: 1 layer, 32 wide) under `unbroken run`, 2
ranks, a fault given to the launcher (`--fault`), figures read from the event log:

- `nan`: `--anomalies`, a NaN in rank 1's gradients at step S (transient): the step it is
  found at (`anomaly_found.step` - S, the target 0), and what the dropped try and its rerun
  cost: rank 0's time from step S-1's end to step S's end, less the median step period
  (`rerun_ms`).
- `spike`: the same for rank 1's loss and gradients x50 at a step past the spike window's
  first 30 steps.
- `sdc`: `--sdc` with K left to the runtime (no `--sdc-every`): one bit of one parameter
  flipped on rank 1 after step S's update; `detect_steps` is the first failing
  `sdc_check`'s step - S, which must not exceed K, the interval in force at the flip (the
  `every` of the last check before it). With 2 replicas the mismatch is `unresolved`, then
  settled by rolling back to the verified copy of the last checkpoint (every 50 steps) and
  recomputing. `--step-sleep 0.05` stands for accelerator time, as in the other
  benchmarks: K is chosen from it. `check_ms`: the median `sdc_check.seconds` (rank 0's
  timer around the checksum and the gather); `overhead_pct`: 100 x the sum of those over
  the sum of rank 0's step durations in the clean arm (the steady state, K chosen by the
  runtime): the checks' cost, timed where it is spent. `overhead_pct_with_fault`: the same
  in this arm, whose extra checks (the first ones before K is timed, the dispute's replay)
  weigh on a 200-step run.
- `straggler`: `--stragglers report`, `--step-sleep 0.05`, rank 1's process 1.5x slower
  from step S for 150 steps: `straggler_flagged.step` - S (the target <= 50).
- `clean`: all three detectors on, no fault, sparse stalls (`--stall-prob 0.05 --stall-max
  3 --step-sleep 0.02`): `false_positives` counts `anomaly_found`, `sdc_mismatch` and
  `straggler_flagged` (the target 0; `job_slow` is shown beside it).
- `per_step`: checks on (`--anomalies --sdc --stragglers report`) against off, and (not
  with `--quick`) the NaN/spike check alone (`--anomalies`: the one check inside every
  step), rounds alternating, no step sleep (the tiny model's 5-10 ms CPU step: the checks'
  largest share); rank 0's median time between step ends per round, its median over
  rounds, and the change. On a noisy 2-core machine rounds of the same job differ by more
  than the checks cost: the timer-based `sdc.overhead_pct` is the figure to trust.

    .venv/bin/python benchmarks/anomalies.py            # ~3.5 minutes
    .venv/bin/python benchmarks/anomalies.py --quick    # < 2 minutes

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from harness import (
    EXAMPLE,
    REPO,
    alternate,
    change_pct,
    emit,
    events_of,
    launch,
    median_of,
    paired_ratios,
    step_period,
    temp_root,
    unbroken_cmd,
    wait_or_kill,
)

sys.path.insert(0, str(REPO / "src"))

from unbroken.runtime.anomalies import replicas  # noqa: E402
from unbroken.runtime.config import SdcConfig  # noqa: E402

WORKERS = 2
TINY = ["--global-batch", "8", "--seq", "32", "--dim", "32", "--layers", "1",
        "--print-every", "100000"]
NAN_AT = 40
SPIKE_AT = 60
SDC_AT = 103  # just past the checkpoint at step 100: the check after it is K's, not a copy's
SDC_CHECKPOINT_EVERY = 50
SLOW_AT = 100
STEP_SLEEP = 0.05
TIMEOUT = 300.0


class Job:
    """One finished job: its launcher's exit code and its events."""

    def __init__(self, code: int | None, events: list[dict]) -> None:
        self.code = code
        self.events = events

    def of(self, name: str, **match: object) -> list[dict]:
        return [e for e in self.events if e["event"] == name
                and all(e.get(k) == v for k, v in match.items())]

    def step_ends(self, rank: int = 0) -> dict[int, float]:
        """Committed step -> the time rank `rank` committed it (the last time, after a replay)."""
        return {e["step"]: e["t"] for e in self.of("step", rank=rank)}


def run_job(root: Path, name: str, args: list[str], faults: Sequence[str] = ()) -> Job:
    run_dir = root / name
    flags = [f for fault in faults for f in ("--fault", fault)]
    proc = launch(unbroken_cmd(WORKERS, run_dir, EXAMPLE, *TINY, *args, flags=flags), run_dir)
    code = wait_or_kill(proc, run_dir, TIMEOUT)
    job = Job(code, events_of(run_dir))
    restarts = len(job.of("restart"))
    note = f", {restarts} restart(s)" if restarts else ""
    print(f"  {name}: exit {code}{note}, {len(job.of('step', rank=0))} steps on rank 0",
          flush=True)
    return job


def numerics_arm(root: Path, kind: str, at: int, steps: int) -> dict:
    """A transient NaN or spike on rank 1 at step `at`: found at which step, and the cost of
    the dropped try and its rerun."""
    fault = (f"nan:rank=1,step={at}" if kind == "nan" else f"spike:rank=1,step={at},scale=50")
    job = run_job(root, kind, ["--steps", str(steps), "--anomalies"], [fault])
    found = [e for e in job.of("anomaly_found") if e["kind"] == kind]
    out: dict = {"at_step": at, "exit": job.code,
                 "detect_steps": found[0]["step"] - at if found else None,
                 "found": len(found)}
    classified = [e for e in job.of("anomaly_classified") if e["step"] == at]
    if classified:
        out["cause"] = classified[0]["cause"]
    if kind == "spike" and found:
        out["score"] = round(found[0]["score"], 1) if found[0].get("score") is not None else None
    ends = job.step_ends()
    period = step_period([ends[s] for s in sorted(ends) if s >= 10])
    dropped = job.of("step_dropped", rank=0, step=at)
    if period is not None and at in ends and at - 1 in ends and dropped:
        out["rerun_ms"] = round(1000 * (ends[at] - ends[at - 1] - period), 2)
        out["dropped_try_ms"] = round(1000 * (dropped[0]["t"] - ends[at - 1]), 2)
        out["step_ms"] = round(1000 * period, 2)
    # Any other finding is a false one: a step the fault did not touch.
    out["other_findings"] = len([e for e in job.of("anomaly_found") if e["step"] != at])
    return out


def sdc_arm(root: Path, steps: int) -> dict:
    """A bit flipped on rank 1 after step SDC_AT; K chosen by the runtime."""
    job = run_job(root, "sdc", [
        "--steps", str(steps), "--sdc", "--step-sleep", str(STEP_SLEEP),
        "--checkpoint-dir", str(root / "sdc-ckpt"),
        "--checkpoint-every", str(SDC_CHECKPOINT_EVERY)], [f"bitflip:rank=1,step={SDC_AT}"])
    checks = job.of("sdc_check", rank=0)
    before = [c for c in checks if c["step"] <= SDC_AT]
    k = before[-1]["every"] if before else None
    failing = [c for c in checks if not c["ok"] and c["step"] > SDC_AT]
    first = failing[0] if failing else None
    durations = [e["duration"] for e in job.of("step", rank=0)]
    seconds = [c["seconds"] for c in checks]
    ends = job.step_ends()
    period = step_period([ends[s] for s in sorted(ends) if 10 <= s < SDC_AT])
    config = job.of("anomaly_config", rank=0)
    settled = job.of("sdc_settled")
    # Why this K: the runtime's own rule (replicas.interval) on what rank 0 knew when it
    # proposed it: the mean of its last 20 earlier checks, its step time (the engine's moving
    # average of step durations) and the checkpoint interval. Each rank proposes and the
    # largest is taken, so rank 1's figures may have made it larger.
    why = None
    if before:
        last = before[-1]
        earlier = [c["seconds"] for c in checks if c["t"] < last["t"]]
        ema = None
        for e in job.of("step", rank=0):
            if e["t"] < last["t"]:
                ema = e["duration"] if ema is None else 0.9 * ema + 0.1 * e["duration"]
        if earlier and ema:
            mean = sum(earlier[-20:]) / len(earlier[-20:])
            expect, rule = replicas.interval(mean, ema, SDC_CHECKPOINT_EVERY, SdcConfig())
            why = (f"{rule}: checks within {SdcConfig().budget:.1%} of a {1000 * ema:.1f} ms "
                   f"step, less the checks at checkpoints (every {SDC_CHECKPOINT_EVERY}); "
                   f"rank 0's mean check so far {1000 * mean:.2f} ms: it proposed "
                   f"K = {expect}" + ("" if expect == last["every"] else
                                      f"; {last['every']} is another rank's larger proposal "
                                      "(from its own checks): the largest is taken"))
        else:
            why = "the first checks, not yet timed"
    return {
        "at_step": SDC_AT, "exit": job.code,
        "detect_steps": first["step"] - SDC_AT if first else None,
        "detected_at": first["step"] if first else None,
        "detected_at_copy": first["at_copy"] if first else None,
        "K": k, "K_all": sorted({c["every"] for c in checks}),
        "K_why": why, "config": config[0]["sdc"] if config else None,
        "check_ms": round(1000 * statistics.median(seconds), 3) if seconds else None,
        "checks": len(checks),
        "overhead_pct": round(100 * sum(seconds) / sum(durations), 3) if durations else None,
        "resolutions": [e["resolution"] for e in job.of("sdc_mismatch")],
        "settled": [e["by"] for e in settled],
        "rolled_back_to": sorted({e["step"] for e in job.of("rolled_back")}),
        "step_ms": round(1000 * period, 2) if period else None,
    }


def straggler_arm(root: Path, steps: int) -> dict:
    job = run_job(root, "straggler", [
        "--steps", str(steps), "--step-sleep", str(STEP_SLEEP), "--stragglers", "report"],
        [f"slow:rank=1,step={SLOW_AT},steps=150,factor=1.5"])
    flags = job.of("straggler_flagged")
    first = flags[0] if flags else None
    return {"at_step": SLOW_AT, "exit": job.code,
            "detect_steps": first["step"] - SLOW_AT if first else None,
            "flagged": [(e["straggler"], e["step"]) for e in flags],
            "since_step": first["since_step"] if first else None,
            "ratio": first["ratio"] if first else None,
            "remedied": [e["action"] for e in job.of("straggler_remedied")]}


ON = ["--anomalies", "--sdc", "--stragglers", "report"]


def clean_arm(root: Path, steps: int) -> dict:
    job = run_job(root, "clean", ["--steps", str(steps), *ON, "--step-sleep", "0.02",
                                  "--stall-prob", "0.05", "--stall-max", "3"])
    durations = sorted(e["duration"] for e in job.of("step", rank=0))
    checks = job.of("sdc_check", rank=0)
    median = durations[len(durations) // 2] if durations else None
    return {
        "steps": steps, "exit": job.code,
        "anomaly_found": len(job.of("anomaly_found")),
        "sdc_mismatch": len(job.of("sdc_mismatch")),
        "straggler_flagged": len(job.of("straggler_flagged")),
        "job_slow": len(job.of("job_slow")),
        "stalled_steps": sum(1 for d in durations if median and d > 1.5 * median),
        "sdc_checks": len(checks),
        "sdc_overhead_pct": (round(100 * sum(c["seconds"] for c in checks) / sum(durations), 3)
                             if durations else None),
    }


NUMERICS = ["--anomalies"]


def per_step(root: Path, rounds: int, steps: int, attribute: bool) -> dict:
    """Rank 0's median time between step ends, per round, with the checks on and off (and,
    with `attribute`, with the per-step NaN/spike check alone: its all-gather every step
    is the only check inside every step; SDC and straggler gathers come every K and every 5
    steps)."""
    arms = ["on", "numerics", "off"] if attribute else ["on", "off"]
    flags = {"on": ON, "numerics": NUMERICS, "off": []}

    def one_round(arm: str, i: int) -> float | None:
        job = run_job(root, f"{arm}-{i}", ["--steps", str(steps), *flags[arm]])
        ends = job.step_ends()
        return step_period([ends[s] for s in sorted(ends) if s >= 20]) if job.code == 0 else None

    times = alternate(arms, rounds, one_round, report=lambda i, arm, t: print(
        f"round {i + 1} checks {arm:8s} "
        f"{f'{1000 * t:.3f} ms/step' if t else 'FAILED'}", flush=True))
    med = {arm: median_of([t for t in times[arm] if t is not None]) for arm in arms}
    on, off = med["on"], med["off"]
    out = {"rounds": rounds, "steps": steps,
           "on_ms": round(1000 * on, 3) if on else None,
           "off_ms": round(1000 * off, 3) if off else None,
           "delta_pct": change_pct(on, off),
           "delta_ms": round(1000 * (on - off), 3) if on and off else None,
           "delta_per_round_pct": [round(100 * x, 2)
                                   for x in paired_ratios(times["off"], times["on"])]}
    if attribute:
        num = med["numerics"]
        out.update({"numerics_only_ms": round(1000 * num, 3) if num else None,
                    "numerics_only_delta_pct": change_pct(num, off),
                    "numerics_only_per_round_pct": [
                        round(100 * x, 2) for x in paired_ratios(times["off"],
                                                                 times["numerics"])]})
    return out


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT MET")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="shorter runs, fewer per-step rounds, no attribution arm (< 2 min)")
    p.add_argument("--clean-steps", type=int, default=None, help="default 600 (quick: 200)")
    p.add_argument("--rounds", type=int, default=None,
                   help="per-step rounds per side (default 4; quick: 2)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs")
    args = p.parse_args()
    clean_steps = args.clean_steps or (200 if args.quick else 600)
    rounds = args.rounds or (2 if args.quick else 4)
    round_steps = 150 if args.quick else 300
    root = temp_root("unbroken-bench-anomalies-", keep=args.keep)

    print("detection", flush=True)
    nan = numerics_arm(root, "nan", NAN_AT, NAN_AT + 20)
    spike = numerics_arm(root, "spike", SPIKE_AT, SPIKE_AT + 20)
    sdc = sdc_arm(root, SDC_AT + (60 if args.quick else 120))
    straggler = straggler_arm(root, SLOW_AT + (60 if args.quick else 100))
    print("false positives", flush=True)
    clean = clean_arm(root, clean_steps)
    print("per-step cost", flush=True)
    cost = per_step(root, rounds, round_steps, attribute=not args.quick)
    if args.keep:
        print(f"run dirs kept in {root}")
    false_positives = clean["anomaly_found"] + clean["sdc_mismatch"] + clean["straggler_flagged"]
    sdc["overhead_pct_with_fault"] = sdc["overhead_pct"]
    sdc["overhead_pct"] = clean["sdc_overhead_pct"]  # the steady state: no fault, no replay

    def within(value: float | None, bound: float | None) -> bool | None:
        return None if value is None or bound is None else value <= bound

    targets = {
        "nan.detect_steps == 0": nan["detect_steps"] == 0,
        "spike.detect_steps == 0": spike["detect_steps"] == 0,
        "sdc.detect_steps <= K": within(sdc["detect_steps"], sdc["K"]),
        "sdc.overhead_pct <= 0.5": within(sdc["overhead_pct"], 0.5),
        "straggler.detect_steps <= 50": within(straggler["detect_steps"], 50),
        "false_positives == 0": false_positives == 0,
    }
    rows = [
        ("nan: found at step S +", nan["detect_steps"], "0", targets["nan.detect_steps == 0"]),
        ("nan: dropped try + rerun, ms", f"{nan.get('rerun_ms')} (step {nan.get('step_ms')} ms)",
         "", None),
        ("spike (x50): found at step S +", spike["detect_steps"], "0",
         targets["spike.detect_steps == 0"]),
        ("spike: dropped try + rerun, ms", f"{spike.get('rerun_ms')} (score {spike.get('score')})",
         "", None),
        ("sdc: first failing check at S +", sdc["detect_steps"], f"<= K = {sdc['K']}",
         targets["sdc.detect_steps <= K"]),
        ("sdc: check, median ms", sdc["check_ms"], "", None),
        ("sdc: checks / step time, % (clean run; the fault's arm: "
         f"{sdc['overhead_pct_with_fault']})", sdc["overhead_pct"], "<= 0.5",
         targets["sdc.overhead_pct <= 0.5"]),
        ("straggler (1.5x): flagged at S +", straggler["detect_steps"], "<= 50",
         targets["straggler.detect_steps <= 50"]),
        (f"clean run, {clean_steps} steps: false positives", false_positives, "0",
         targets["false_positives == 0"]),
        ("per step: checks on / off, ms", f"{cost['on_ms']} / {cost['off_ms']}", "", None),
        ("per step: change, %", f"{cost['delta_pct']} (rounds {cost['delta_per_round_pct']})",
         "", None),
    ]
    if "numerics_only_ms" in cost:
        rows.append(("per step: NaN/spike check alone, ms / change %",
                     f"{cost['numerics_only_ms']} / {cost['numerics_only_delta_pct']}", "", None))
    print()
    print(f"| {'figure':48s} | {'value':44s} | {'target':12s} | |")
    print(f"|{'-' * 50}|{'-' * 46}|{'-' * 14}|---|")
    for name, value, target, ok in rows:
        print(f"| {name:48s} | {str(value):44s} | {target:12s} | {_met(ok) if target else ''} |")
    print()
    print(f"sdc: K {sdc['K']} at the flip (K over the run: {sdc['K_all']}); {sdc['K_why']}; "
          f"mismatch {sdc['resolutions']}, settled by {sdc['settled']}")
    print(f"straggler: flagged {straggler['flagged']} (onset estimated at step "
          f"{straggler['since_step']}, ratio {straggler['ratio']}), remedy {straggler['remedied']}")
    print(f"clean run: {clean}")
    print("per step: on this noisy 2-core machine rounds of one job differ by more than the "
          "checks cost; the timer-based sdc.overhead_pct is the reliable figure")
    emit({"benchmark": "anomalies", "workers": WORKERS, "quick": args.quick,
          "nan": nan, "spike": spike, "sdc": sdc, "straggler": straggler,
          "false_positives": false_positives, "clean": clean, "per_step": cost,
          "targets": targets})


if __name__ == "__main__":
    main()
