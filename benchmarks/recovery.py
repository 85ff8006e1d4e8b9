"""Recovery from a SIGKILLed worker: torchrun's restart, unbroken's full restart, and unbroken
in place, side by side in one run; plus steady-state step time against a plain DDP loop.

Each arm runs the example (examples/gpt/train.py: 4 workers, DDP over gloo, checkpoint every
10 steps). Once training passes step KILL_AT the benchmark SIGKILLs rank 1 from outside and
measures, from the job's event log:

- kill-to-first-resumed-step: from the kill to the first step completed by the recovered job
  (the next attempt after a restart, the next generation in place);
- lost steps: steps committed before the kill that had to be computed again.

Arms: `torchrun` (`python -m torch.distributed.run --max-restarts 3`, c10d rendezvous),
`unbroken-restart` (`unbroken run --on-fault restart`: every worker restarted from the last
checkpoint, forked by the node's fork server), `unbroken` (`unbroken run`: survivors recover
in place). The kill comes at step KILL_AT, a few seconds in: no warm process needs time to
get ready (the fork server has imported before the first worker started).

A replacement's start: from its process's start (the fork) to the end of its
`unbroken.init()` (the `worker_start` event's `startup`), an upper bound of the time from
the fork to the script's first line.
Tries alternate between the arms so machine noise hits all of them.

Steady state: the same step as a plain DDP loop (benchmarks/plain_ddp.py under torchrun)
against the example under `unbroken run` with no faults and no checkpoints, alternating
rounds; the figure is the median wall time between consecutive steps of rank 0.

    .venv/bin/python benchmarks/recovery.py --tries 10

The last line printed is one JSON object with the figures and their ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
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
    ratio,
    step_period,
    temp_root,
    torchrun_cmd,
    unbroken_cmd,
    wait_or_kill,
)

PLAIN = REPO / "benchmarks" / "plain_ddp.py"
sys.path.insert(0, str(REPO / "src"))

# Steady state, a few seconds into training, and mid-way between two checkpoints (every 10
# steps), where a fault lands on average.
KILL_AT = 125
STEPS = 160
ARMS = ["torchrun", "unbroken-restart", "unbroken"]
STARTUPS: list[float] = []  # each in-place try's replacements: fork to the end of init, s


def _command(arm: str, run_dir: Path, workers: int, steps: int, checkpoints: bool) -> list[str]:
    args = ["--steps", str(steps), "--print-every", "100000"]
    if checkpoints:
        args += ["--checkpoint-dir", str(run_dir / "ckpt"), "--checkpoint-every", "10"]
    if arm == "torchrun":
        return torchrun_cmd(workers, EXAMPLE, run_dir.name, *args)
    policy = ["--on-fault", "restart"] if arm == "unbroken-restart" else []
    return unbroken_cmd(workers, run_dir, EXAMPLE, *args, flags=policy)


def one_fault(arm: str, root: Path, index: int, workers: int, hang_after: float) -> Try:
    run_dir = root / f"{arm}-{index}"
    proc = launch(_command(arm, run_dir, workers, STEPS, checkpoints=True), run_dir)
    try:
        fault = inject_fault(arm, proc, EventTail(run_dir), KILL_AT, timeout=180,
                             hang_after=hang_after)
        if not isinstance(fault, Fault):
            return fault
        recovery = fault.resumed["t"] - fault.killed_at
        code = wait_or_kill(proc, run_dir, 120)
        if code is None:
            return Try(arm, hang=True, recovery=recovery)
        evs = events_of(run_dir)
        if arm == "unbroken":
            STARTUPS.extend(e["startup"] for e in evs if e["event"] == "worker_start"
                            and e.get("joining") and e.get("startup") is not None)
        last = max(e["step"] for e in evs if e["event"] == "step")
        return Try(arm, exit=code, recovery=recovery,
                   lost_steps=lost_steps(evs, fault.killed_at, fault.resumed),
                   finished=code == 0 and last + 1 == STEPS)
    finally:
        kill_everything(proc, run_dir)


def steady_step_time(kind: str, root: Path, index: int, workers: int, steps: int,
                     warmup: int) -> float | None:
    """Median seconds between consecutive steps of rank 0, after `warmup` steps."""
    run_dir = root / f"steady-{kind}-{index}"
    log = run_dir / "steps.jsonl"
    if kind == "plain":
        cmd = torchrun_cmd(workers, PLAIN, run_dir.name, "--steps", str(steps),
                           "--timing-file", str(log))
    else:
        cmd = _command("unbroken", run_dir, workers, steps, checkpoints=False)
    if wait_or_kill(launch(cmd, run_dir), run_dir, 300) is None:
        return None
    if kind == "plain":
        if not log.exists():
            return None
        ends = [json.loads(line)["t"] for line in log.read_text().splitlines()][warmup:]
    else:
        evs = events_of(run_dir)
        ends = [e["t"] for e in evs if e["event"] == "step" and e["rank"] == 0][warmup:]
    return step_period(ends, least=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=10, help="faults per arm (at least 10 for the record)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="steady-state rounds per side")
    p.add_argument("--steady-steps", type=int, default=800)
    p.add_argument("--hang-after", type=float, default=30.0)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args()
    root = temp_root("unbroken-bench-recovery-", keep=args.keep)

    def show(i: int, arm: str, r: Try) -> None:
        print(f"try {i + 1:2d} {arm:16s} kill-to-resumed-step {r.shown()}"
              f"{'  (did not finish)' if r.finished is False else ''}", flush=True)

    results = alternate(ARMS, args.tries,
                        lambda arm, i: one_fault(arm, root, i, args.workers, args.hang_after),
                        report=show)

    def show_steady(i: int, kind: str, t: float | None) -> None:
        print(f"steady round {i + 1} {kind:9s} {1000 * t:.2f} ms/step" if t else
              f"steady round {i + 1} {kind:9s} FAILED", flush=True)

    steady = alternate(["plain", "unbroken"], args.rounds,
                       lambda kind, i: steady_step_time(kind, root, i, args.workers,
                                                        args.steady_steps, warmup=50),
                       report=show_steady)
    summary = {arm: ArmStats.of(rs) for arm, rs in results.items()}
    plain = median_of([t for t in steady["plain"] if t is not None])
    ours = median_of([t for t in steady["unbroken"] if t is not None])
    overhead = change_pct(ours, plain)
    t, r, u = summary["torchrun"].median_s, summary["unbroken-restart"].median_s, \
        summary["unbroken"].median_s

    print()
    for arm, s in summary.items():
        print(f"{arm:16s} median {s.median_s}s  p90 {s.p90_s}s  lost steps median "
              f"{s.lost_steps_median} max {s.lost_steps_max}  hangs {s.hangs}/{s.tries}  "
              f"failed {s.failed}")
    print(f"torchrun / unbroken in place: {ratio(t, u)}x;  unbroken restart / in place: {ratio(r, u)}x;"
          f"  torchrun / unbroken restart: {ratio(t, r)}x")
    startup = median_of(STARTUPS)
    if startup is not None:
        print(f"a replacement's start (fork to the end of init): median {startup:.3f}s, "
              f"max {max(STARTUPS):.3f}s over {len(STARTUPS)}")
    if plain and ours:
        print(f"steady state: plain DDP {1000 * plain:.2f} ms/step, unbroken {1000 * ours:.2f} ms/step, "
              f"overhead {overhead:+.2f}%")
    if args.keep:
        print(f"run directories kept in {root}")
    emit({
        "benchmark": "recovery", "workers": args.workers, "kill_at_step": KILL_AT,
        **{arm: s.as_json() for arm, s in summary.items()},
        "ratio_median_torchrun_over_in_place": ratio(t, u),
        "ratio_median_restart_over_in_place": ratio(r, u),
        "ratio_median_torchrun_over_restart": ratio(t, r),
        "replacement_startup_median_s": round(startup, 4) if startup is not None else None,
        "replacement_startup_max_s": round(max(STARTUPS), 4) if STARTUPS else None,
        "steady_plain_ms": round(1000 * plain, 3) if plain else None,
        "steady_unbroken_ms": round(1000 * ours, 3) if ours else None,
        "steady_overhead_pct": overhead,
    })


if __name__ == "__main__":
    main()
