"""Recovery with a hot spare, in place without one, and torchrun, side by side in one run;
plus the steady-state cost of an idle spare.

Each arm runs the example (examples/gpt/train.py, 4 workers, DDP over gloo, checkpoint every
10 steps) with `--step-sleep 0.04`: every step waits 40 ms, standing in for accelerator time,
because on a GPU host the CPUs are mostly idle, and a spare warms up on idle CPU only
(SCHED_IDLE). Once training passes step KILL_AT (and, in the spare arm, the spare is
ready) the benchmark SIGKILLs rank 1 and measures the time from the kill to the first step
the recovered job completes. Arms:

- `torchrun`: `python -m torch.distributed.run --max-restarts 3`, c10d rendezvous;
- `unbroken`: `unbroken run`: the survivors recover in place, shrunk to 3 until a
  replacement joins;
- `unbroken-spare`: `unbroken run --spares 1`: the spare takes rank 1 in the next
  generation, the world size stays 4.

Tries alternate between the arms. Steady state: `--spares 1` against `--spares 0`, no
fault, no checkpoint, alternating rounds; the figure is the median time between consecutive
steps of rank 0 once the spare (and the warm standbys) are ready.

    .venv/bin/python benchmarks/spares.py --tries 10

The last line printed is one JSON object with the figures and their ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt" / "train.py"
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import (  # noqa: E402
    EventTail,
    kill_and_time,
    kill_everything,
    step_period,
    wait_for_victim,
)
from recovery import _events, _launch, _stats, _torchrun  # noqa: E402

KILL_AT = 125
STEPS = 600  # never reached: a try ends a few steps after the recovery
STEP_SLEEP = "0.04"
ARMS = ["torchrun", "unbroken", "unbroken-spare"]


def _command(arm: str, run_dir: Path, workers: int, steps: int, checkpoints: bool,
             spares: int = 0) -> list[str]:
    args = ["--steps", str(steps), "--print-every", "100000", "--step-sleep", STEP_SLEEP]
    if checkpoints:
        args += ["--checkpoint-dir", str(run_dir / "ckpt"), "--checkpoint-every", "10"]
    if arm == "torchrun":
        return _torchrun(workers, EXAMPLE, run_dir, *args)
    if arm == "unbroken-spare":
        spares = 1
    return [sys.executable, "-m", "unbroken", "run", "--standalone", "--nproc-per-node", str(workers),
            "--max-restarts", "3", "--run-dir", str(run_dir), "--spares", str(spares),
            str(EXAMPLE), *args]


def one_fault(arm: str, root: Path, index: int, workers: int, hang_after: float) -> dict:
    run_dir = root / f"{arm}-{index}"
    proc = _launch(_command(arm, run_dir, workers, STEPS, checkpoints=True), run_dir)
    tail = EventTail(run_dir)
    try:
        spare_ready = (lambda events: any(e["event"] == "spare_ready" for e in events)) \
            if arm == "unbroken-spare" else (lambda events: True)
        victim = wait_for_victim(proc, tail, KILL_AT, rank=1, timeout=240, ready=spare_ready)
        if victim is None:
            return {"arm": arm, "error": "never reached the kill step (or the spare never got ready)"}
        killed_at, resumed = kill_and_time(proc, tail, victim, hang_after)
        if isinstance(resumed, str):
            return {"arm": arm, "error": resumed}
        if resumed is None:
            return {"arm": arm, "hang": True}
        time.sleep(1.0)  # a few more steps, then the try is over
        evs = _events(run_dir)
        steps = [e for e in evs if e["event"] == "step"]
        committed = max((e["step"] for e in steps if e["t"] <= killed_at), default=-1)
        plans = [e["world_size"] for e in evs if e["event"] == "gen_plan"]
        return {"arm": arm, "recovery": resumed["t"] - killed_at,
                "lost_steps": max(0, committed + 1 - resumed["step"]),
                "world_size_after": plans[0] if plans else None,
                "promoted": any(e["event"] == "spare_promoted" for e in evs)}
    finally:
        kill_everything(proc, run_dir)


def steady_step_time(spares: int, root: Path, index: int, workers: int, steps: int) -> float | None:
    run_dir = root / f"steady-{spares}-{index}"
    proc = _launch(_command("unbroken", run_dir, workers, steps, checkpoints=False, spares=spares),
                   run_dir)
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        kill_everything(proc, run_dir)
        return None
    evs = _events(run_dir)
    ready = max((e["t"] for e in evs if e["event"] in ("standby_ready", "spare_ready")), default=0.0)
    if spares and not any(e["event"] == "spare_ready" for e in evs):
        return None  # the spare never got warm: not the steady state we measure
    ends = [e["t"] for e in evs if e["event"] == "step" and e["rank"] == 0 and e["t"] > ready]
    return step_period(ends)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=10,
                   help="faults per arm (at least 10 for the record; 0: steady state only)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="steady-state rounds per side")
    p.add_argument("--steady-steps", type=int, default=500)
    p.add_argument("--hang-after", type=float, default=30.0)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="unbroken-bench-spares-"))
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        for i in range(args.tries):
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                r = one_fault(arm, root, i, args.workers, args.hang_after)
                results[arm].append(r)
                shown = (f"{r['recovery']:.3f}s, {r['lost_steps']} lost step(s), world size after "
                         f"{r['world_size_after']}, spare promoted: {r['promoted']}"
                         if "recovery" in r else "HANG" if r.get("hang") else r.get("error"))
                print(f"try {i + 1:2d} {arm:15s} kill-to-resumed-step {shown}", flush=True)
        steady: dict[int, list[float]] = {0: [], 1: []}
        paired: list[float] = []  # per round: with a spare / without, run back to back
        for i in range(args.rounds):
            got = {}
            for spares in (0, 1) if i % 2 == 0 else (1, 0):
                t = steady_step_time(spares, root, i, args.workers, args.steady_steps)
                if t is not None:
                    steady[spares].append(t)
                    got[spares] = t
                print(f"steady round {i + 1} spares={spares} "
                      f"{f'{1000 * t:.2f} ms/step' if t else 'FAILED'}", flush=True)
            if len(got) == 2:
                paired.append(got[1] / got[0] - 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {arm: _stats(rs) for arm, rs in results.items()}
    for arm, rs in results.items():
        summary[arm]["world_size_after"] = sorted({r.get("world_size_after") for r in rs
                                                   if r.get("world_size_after")})
        summary[arm]["spare_promoted"] = sum(1 for r in rs if r.get("promoted"))
    none = statistics.median(steady[0]) if steady[0] else None
    idle = statistics.median(steady[1]) if steady[1] else None
    cost = round(100 * (idle / none - 1), 2) if none and idle else None
    # Rounds differ by a few percent on this machine; the ratio within each round is steadier.
    paired_cost = round(100 * statistics.median(paired), 2) if paired else None
    t, u, s = summary["torchrun"], summary["unbroken"], summary["unbroken-spare"]

    def ratio(a: dict, b: dict) -> float | None:
        return round(a["median_s"] / b["median_s"], 1) if a["median_s"] and b["median_s"] else None

    print()
    for arm, st in summary.items():
        print(f"{arm:15s} median {st['median_s']}s  p90 {st['p90_s']}s  lost steps median "
              f"{st['lost_steps_median']}  world size after {st['world_size_after']}  "
              f"hangs {st['hangs']}/{st['tries']}  failed {st['failed']}")
    print(f"torchrun / spare: {ratio(t, s)}x;  in place without a spare / spare: {ratio(u, s)}x")
    if none and idle:
        print(f"steady state: no spare {1000 * none:.2f} ms/step, an idle spare {1000 * idle:.2f} "
              f"ms/step: {cost:+.2f}% (median of the per-round ratios: {paired_cost:+.2f}%)")
    print(json.dumps({
        "benchmark": "spares", "workers": args.workers, "kill_at_step": KILL_AT,
        "step_sleep_s": float(STEP_SLEEP), **summary,
        "ratio_median_torchrun_over_spare": ratio(t, s),
        "ratio_median_in_place_over_spare": ratio(u, s),
        "steady_no_spare_ms": round(1000 * none, 3) if none else None,
        "steady_idle_spare_ms": round(1000 * idle, 3) if idle else None,
        "idle_spare_cost_pct": cost,
        "idle_spare_cost_paired_pct": paired_cost,
        "idle_spare_cost_per_round_pct": [round(100 * p, 2) for p in paired],
    }))


if __name__ == "__main__":
    main()
