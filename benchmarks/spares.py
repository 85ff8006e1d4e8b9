"""Recovery with a hot spare, in place without one, and torchrun, side by side in one run;
plus the steady-state cost of an idle spare, and the spare refilled after a promotion
(forked by the node's fork server): its own CPU seconds and its wall time to ready.

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
steps of rank 0 once the spare (and the warm interpreters) are ready.

    .venv/bin/python benchmarks/spares.py --tries 10

The last line printed is one JSON object with the figures and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness import (
    EXAMPLE,
    REPO,
    ArmStats,
    EventTail,
    Fault,
    Try,
    alternate,
    change_pct,
    emit,
    events_of,
    inject_fault,
    kill_everything,
    launch,
    lost_steps,
    median_of,
    paired_ratios,
    ratio,
    step_period,
    temp_root,
    torchrun_cmd,
    unbroken_cmd,
    wait_or_kill,
)

sys.path.insert(0, str(REPO / "src"))

KILL_AT = 125
STEPS = 600  # never reached: a try ends a few steps after the recovery
STEP_SLEEP = "0.04"
ARMS = ["torchrun", "unbroken", "unbroken-spare"]


@dataclass
class SpareTry(Try):
    """A try, and the world size of the first generation planned after the fault, and
    whether a spare was promoted."""

    world_size_after: int | None = None
    promoted: bool = False
    refill_cpu: float | None = None  # the spare started after the promotion: its own CPU s
    refill_wall: float | None = None  # and its wall time, from its start to ready


REFILL_WAIT = 60.0  # seconds a try waits for the refilled spare to be ready


def refill(run_dir: Path, killed_at: float) -> tuple[float | None, float | None]:
    """The spare started after the kill (the refill, forked by the node's fork server): its
    own CPU seconds to ready (`spare_ready.cpu`) and its wall time from `spare_started`."""
    deadline = time.monotonic() + REFILL_WAIT
    while time.monotonic() < deadline:
        evs = events_of(run_dir)
        started = {e["wid"]: e["t"] for e in evs
                   if e["event"] == "spare_started" and e["t"] > killed_at}
        ready = [e for e in evs if e["event"] == "spare_ready" and e.get("wid") in started]
        if ready:
            return ready[0].get("cpu"), round(ready[0]["t"] - started[ready[0]["wid"]], 3)
        time.sleep(0.2)
    return None, None


def _command(arm: str, run_dir: Path, workers: int, steps: int, checkpoints: bool,
             spares: int = 0) -> list[str]:
    args = ["--steps", str(steps), "--print-every", "100000", "--step-sleep", STEP_SLEEP]
    if checkpoints:
        args += ["--checkpoint-dir", str(run_dir / "ckpt"), "--checkpoint-every", "10"]
    if arm == "torchrun":
        return torchrun_cmd(workers, EXAMPLE, run_dir.name, *args)
    if arm == "unbroken-spare":
        spares = 1
    return unbroken_cmd(workers, run_dir, EXAMPLE, *args, flags=["--spares", str(spares)])


def one_fault(arm: str, root: Path, index: int, workers: int, hang_after: float) -> Try:
    run_dir = root / f"{arm}-{index}"
    proc = launch(_command(arm, run_dir, workers, STEPS, checkpoints=True), run_dir)
    try:
        spare_ready = (lambda events: any(e["event"] == "spare_ready" for e in events)) \
            if arm == "unbroken-spare" else (lambda events: True)
        fault = inject_fault(arm, proc, EventTail(run_dir), KILL_AT, timeout=240,
                             hang_after=hang_after, ready=spare_ready,
                             not_reached="never reached the kill step (or the spare never got ready)")
        if not isinstance(fault, Fault):
            return fault
        time.sleep(1.0)  # a few more steps, then the try is over
        cpu, wall = refill(run_dir, fault.killed_at) if arm == "unbroken-spare" else (None, None)
        evs = events_of(run_dir)
        plans = [e["world_size"] for e in evs if e["event"] == "gen_plan"]
        return SpareTry(arm, recovery=fault.resumed["t"] - fault.killed_at,
                        lost_steps=lost_steps(evs, fault.killed_at, fault.resumed),
                        world_size_after=plans[0] if plans else None,
                        promoted=any(e["event"] == "spare_promoted" for e in evs),
                        refill_cpu=cpu, refill_wall=wall)
    finally:
        kill_everything(proc, run_dir)


def steady_step_time(spares: int, root: Path, index: int, workers: int, steps: int) -> float | None:
    run_dir = root / f"steady-{spares}-{index}"
    proc = launch(_command("unbroken", run_dir, workers, steps, checkpoints=False, spares=spares),
                  run_dir)
    if wait_or_kill(proc, run_dir, 600) is None:
        return None
    evs = events_of(run_dir)
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
    root = temp_root("unbroken-bench-spares-")

    def show(i: int, arm: str, r: Try) -> None:
        shown = (f"{r.shown()}, world size after {r.world_size_after}, spare promoted: "
                 f"{r.promoted}" if isinstance(r, SpareTry) else r.shown())
        if isinstance(r, SpareTry) and r.refill_wall is not None:
            shown += f", refilled spare ready in {r.refill_wall} s ({r.refill_cpu} s CPU)"
        print(f"try {i + 1:2d} {arm:15s} kill-to-resumed-step {shown}", flush=True)

    results = alternate(ARMS, args.tries,
                        lambda arm, i: one_fault(arm, root, i, args.workers, args.hang_after),
                        report=show)

    def show_steady(i: int, side: str, t: float | None) -> None:
        print(f"steady round {i + 1} spares={side} "
              f"{f'{1000 * t:.2f} ms/step' if t else 'FAILED'}", flush=True)

    steady = alternate(["0", "1"], args.rounds,
                       lambda side, i: steady_step_time(int(side), root, i, args.workers,
                                                        args.steady_steps),
                       report=show_steady)
    paired = paired_ratios(steady["0"], steady["1"])  # per round: with a spare / without
    summary = {arm: ArmStats.of(rs).as_json() for arm, rs in results.items()}
    for arm, rs in results.items():
        spared = [r for r in rs if isinstance(r, SpareTry)]
        summary[arm]["world_size_after"] = sorted({r.world_size_after for r in spared
                                                   if r.world_size_after})
        summary[arm]["spare_promoted"] = sum(1 for r in spared if r.promoted)
        if arm == "unbroken-spare":
            cpus = [r.refill_cpu for r in spared if r.refill_cpu is not None]
            walls = [r.refill_wall for r in spared if r.refill_wall is not None]
            summary[arm]["refill_cpu_median_s"] = median_of(cpus)
            summary[arm]["refill_cpu_max_s"] = max(cpus, default=None)
            summary[arm]["refill_wall_median_s"] = median_of(walls)
            summary[arm]["refills_ready"] = len(walls)
    none = median_of([t for t in steady["0"] if t is not None])
    idle = median_of([t for t in steady["1"] if t is not None])
    cost = change_pct(idle, none)
    # Rounds differ by a few percent on this machine; the ratio within each round is steadier.
    paired_cost = round(100 * statistics.median(paired), 2) if paired else None
    t, u, s = (summary[arm]["median_s"] for arm in ("torchrun", "unbroken", "unbroken-spare"))

    print()
    for arm, st in summary.items():
        print(f"{arm:15s} median {st['median_s']}s  p90 {st['p90_s']}s  lost steps median "
              f"{st['lost_steps_median']}  world size after {st['world_size_after']}  "
              f"hangs {st['hangs']}/{st['tries']}  failed {st['failed']}")
    print(f"torchrun / spare: {ratio(t, s)}x;  in place without a spare / spare: {ratio(u, s)}x")
    if none and idle:
        print(f"steady state: no spare {1000 * none:.2f} ms/step, an idle spare {1000 * idle:.2f} "
              f"ms/step: {cost:+.2f}% (median of the per-round ratios: {paired_cost:+.2f}%)")
    emit({
        "benchmark": "spares", "workers": args.workers, "kill_at_step": KILL_AT,
        "step_sleep_s": float(STEP_SLEEP), **summary,
        "ratio_median_torchrun_over_spare": ratio(t, s),
        "ratio_median_in_place_over_spare": ratio(u, s),
        "steady_no_spare_ms": round(1000 * none, 3) if none else None,
        "steady_idle_spare_ms": round(1000 * idle, 3) if idle else None,
        "idle_spare_cost_pct": cost,
        "idle_spare_cost_paired_pct": paired_cost,
        "idle_spare_cost_per_round_pct": [round(100 * p, 2) for p in paired],
    })


if __name__ == "__main__":
    main()
