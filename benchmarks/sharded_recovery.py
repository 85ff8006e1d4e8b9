"""Recovery of a sharded (FSDP2) job: in place from in-memory snapshots, against today's
full restart from the checkpoint and torchrun, side by side in one run; plus the per-step
cost of the snapshots and the host memory they take.

Each arm runs benchmarks/fsdp_worker.py: 4 workers, FSDP2 over gloo, 201 MB of model and
AdamW state in total, a storage checkpoint every 20 steps, `--step-sleep 0.04` standing in
for accelerator time. Once training passes step KILL_AT (and in the in-memory arm the spare
is warm and the snapshot interval agreed) the benchmark SIGKILLs rank 1 and measures the
time from the kill to the first step the recovered job completes, and the committed steps
lost. Arms:

- `torchrun`: `python -m torch.distributed.run --max-restarts 3`: every worker restarts and
  loads the checkpoint;
- `restart`: `unbroken run --on-fault restart`: today's path for a sharded job, the same;
- `in_memory`: `unbroken run --spares 1`: the spare takes rank 1 with its shard from the
  buddy's in-memory snapshot; the survivors roll back to it in memory.

Two times per try: to the end of the first resumed step (the issue's figure; it includes
that step, about 0.8 s here, where FSDP's all-gathers of 67 MB over gloo on 2 cores make
the step long), and to its start (the recovery itself).

Snapshot cost: steady runs with snapshots at the automatic interval against
`--snapshot-every 0` (none), both with the checkpoint every 20 steps, alternating; the figure
is the median of the per-round ratios of rank 0's median step time.

Host memory: `host_mb_per_rank` is every copy together (the storage checkpoint's included:
it persists from the snapshots' own copy), against `shard_mb_per_rank`. Lost steps: each
in-memory try also counts what a restart from the newest checkpoint durable at the kill
would have redone (`restart_would_lose_max`); `lost_over_restart_max` is the most steps in
place redid beyond that (the target: never above 0).

    .venv/bin/python benchmarks/sharded_recovery.py --tries 10 --baseline-tries 3

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
    REPO,
    ArmStats,
    EventTail,
    Fault,
    Try,
    alternate,
    emit,
    events_of,
    inject_fault,
    kill_everything,
    launch,
    lost_steps,
    median_of,
    paired_ratios,
    ratio,
    restart_would_lose,
    step_period,
    temp_root,
    torchrun_cmd,
    unbroken_cmd,
    wait_or_kill,
)

WORKER = REPO / "benchmarks" / "fsdp_worker.py"
sys.path.insert(0, str(REPO / "src"))

KILL_AT = 40
"""Try i of every arm kills at step KILL_AT + (7 i mod 20): the faults of 10 tries (3 of a
baseline) land across a whole checkpoint period (a checkpoint every 20 steps), so each arm's
lost steps are sampled from just after a save to just before the next one."""
STEP_SLEEP = "0.04"
ARMS = ["torchrun", "restart", "in_memory"]


@dataclass
class ShardedTry(Try):
    """A try, and: seconds from the fault to the start of the first resumed step
    (`to_start`); the snapshot interval and host bytes the job agreed; whether the spare was
    promoted, and whether anything was loaded from storage after the fault."""

    to_start: float | None = None
    every: int | None = None
    host_bytes: int | None = None
    shard_bytes: int | None = None
    restart_would_lose: int | None = None
    """Steps a restart from the newest checkpoint durable at the kill would have redone."""
    promoted: bool = False
    from_storage: bool = False


def _command(arm: str, run_dir: Path, workers: int, steps: int,
             snapshot_every: int | None) -> list[str]:
    args = ["--steps", str(steps), "--step-sleep", STEP_SLEEP,
            "--checkpoint-dir", str(run_dir / "ckpt"), "--checkpoint-every", "20"]
    if snapshot_every is not None:
        args += ["--snapshot-every", str(snapshot_every)]
    if arm == "torchrun":
        return torchrun_cmd(workers, WORKER, run_dir.name, *args)
    extra = ["--on-fault", "restart"] if arm == "restart" else ["--spares", "1"] \
        if arm == "in_memory" else []
    return unbroken_cmd(workers, run_dir, WORKER, *args, flags=extra)


def _ready(arm: str):
    if arm != "in_memory":
        return lambda events: True
    return lambda events: (any(e["event"] == "spare_ready" for e in events)
                           and any(e["event"] == "snapshot_config" for e in events))


def one_fault(arm: str, root: Path, index: int, workers: int, hang_after: float) -> Try:
    run_dir = root / f"{arm}-{index}"
    proc = launch(_command(arm, run_dir, workers, 1000, None), run_dir)
    try:
        fault = inject_fault(arm, proc, EventTail(run_dir), KILL_AT + (7 * index) % 20, timeout=400,
                             hang_after=hang_after, ready=_ready(arm),
                             not_reached="never reached the kill step (or the spare never got ready)")
        if not isinstance(fault, Fault):
            return fault
        time.sleep(0.5)
        evs = events_of(run_dir)
        killed_at, resumed = fault.killed_at, fault.resumed
        config = [e for e in evs if e["event"] == "snapshot_config"]
        return ShardedTry(arm, recovery=resumed["t"] - killed_at,
                          to_start=resumed["t"] - resumed["duration"] - killed_at,
                          lost_steps=lost_steps(evs, killed_at, resumed),
                          every=config[0]["every"] if config else None,
                          host_bytes=config[0]["host_bytes"] if config else None,
                          shard_bytes=config[0]["shard_bytes"] if config else None,
                          restart_would_lose=restart_would_lose(evs, killed_at),
                          promoted=any(e["event"] == "spare_promoted" for e in evs),
                          from_storage=any(e["event"] == "checkpoint_loaded"
                                           and e["t"] > killed_at for e in evs))
    finally:
        kill_everything(proc, run_dir)


def steady(snapshot_every: int | None, root: Path, index: int, workers: int, steps: int,
           ) -> tuple[float | None, dict | None]:
    """Rank 0's median step time once the interval is agreed; the snapshot_config event."""
    run_dir = root / f"steady-{snapshot_every}-{index}"
    proc = launch(_command("unbroken", run_dir, workers, steps, snapshot_every), run_dir)
    if wait_or_kill(proc, run_dir, 900) is None:
        return None, None
    evs = events_of(run_dir)
    config = next((e for e in evs if e["event"] == "snapshot_config"), None)
    ends = [e["t"] for e in evs if e["event"] == "step" and e["rank"] == 0 and e["step"] >= 20]
    return step_period(ends), config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=10, help="faults in the in-memory arm (>= 10)")
    p.add_argument("--baseline-tries", type=int, default=3,
                   help="faults in the torchrun and restart arms (each takes tens of seconds)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="steady-state rounds per side")
    p.add_argument("--steady-steps", type=int, default=120)
    p.add_argument("--hang-after", type=float, default=120.0)
    args = p.parse_args()
    root = temp_root("unbroken-bench-sharded-")

    def show(i: int, arm: str, r: Try) -> None:
        shown = (f"{r.shown()}, snapshot every {r.every}, spare promoted: {r.promoted}, "
                 f"from storage: {r.from_storage}" if isinstance(r, ShardedTry) else r.shown())
        print(f"try {i + 1:2d} {arm:10s} kill-to-resumed-step {shown}", flush=True)

    results = alternate(ARMS, max(args.tries, args.baseline_tries),
                        lambda arm, i: one_fault(arm, root, i, args.workers, args.hang_after),
                        tries={"in_memory": args.tries, "torchrun": args.baseline_tries,
                               "restart": args.baseline_tries},
                        report=show)
    def one_round(side: str, i: int) -> float | None:
        t, config = steady(0 if side == "none" else None, root, i, args.workers,
                           args.steady_steps)
        every_note = f" (every {config['every']} steps)" if config else ""
        print(f"steady round {i + 1} snapshots={side} "
              f"{f'{1000 * t:.2f} ms/step' if t else 'FAILED'}{every_note}", flush=True)
        return t

    times = alternate(["none", "auto"], args.rounds, one_round)
    paired = paired_ratios(times["none"], times["auto"])
    summary = {arm: ArmStats.of(rs).as_json() for arm, rs in results.items()}
    for arm, rs in results.items():  # to the resumed step's start: recovery without the step
        starts = [r.to_start for r in rs if isinstance(r, ShardedTry) and r.to_start is not None]
        summary[arm]["to_start_median_s"] = median_of(starts, 3)
    mem = [r for r in results["in_memory"] if isinstance(r, ShardedTry)]
    summary["in_memory"]["from_storage"] = sum(1 for r in mem if r.from_storage)
    summary["in_memory"]["spare_promoted"] = sum(1 for r in mem if r.promoted)
    every = sorted({r.every for r in mem if r.every})
    host = [(r.host_bytes, r.shard_bytes) for r in mem if r.host_bytes]
    host_mb = round(host[0][0] / 1e6, 1) if host else None
    shard_mb = round(host[0][1] / 1e6, 1) if host else None
    over = [r.lost_steps - r.restart_would_lose for r in mem
            if r.lost_steps is not None and r.restart_would_lose is not None]
    summary["in_memory"]["restart_would_lose_max"] = max(
        (r.restart_would_lose for r in mem if r.restart_would_lose is not None), default=None)
    summary["in_memory"]["lost_over_restart_max"] = max(over, default=None)
    overhead = round(100 * statistics.median(paired), 2) if paired else None
    t, r, m = summary["torchrun"], summary["restart"], summary["in_memory"]
    none = median_of([x for x in times["none"] if x is not None])
    auto = median_of([x for x in times["auto"] if x is not None])

    print()
    for arm, st in summary.items():
        print(f"{arm:10s} median {st['median_s']}s (to the step's start {st['to_start_median_s']}s)"
              f"  p90 {st['p90_s']}s  lost steps max "
              f"{st['lost_steps_max']}  hangs {st['hangs']}/{st['tries']}  failed {st['failed']}")
    print(f"torchrun / in-memory: {ratio(t['median_s'], m['median_s'])}x;  restart / in-memory: "
          f"{ratio(r['median_s'], m['median_s'])}x;  "
          f"snapshot every {every} step(s), {host_mb} MB of host memory per rank for every "
          f"copy ({shard_mb} MB of shards), in place redid at most "
          f"{max(over, default=None)} step(s) more than a restart would have, "
          f"per-step overhead {overhead}% (per round: {[round(100 * x, 2) for x in paired]})")
    emit({
        "benchmark": "sharded_recovery", "workers": args.workers, "kill_at_step": KILL_AT,
        "state_mb_total": 201.3, "step_sleep_s": float(STEP_SLEEP),
        "in_memory": m, "restart": r, "torchrun": t,
        "ratio_torchrun_over_in_memory": ratio(t["median_s"], m["median_s"]),
        "ratio_restart_over_in_memory": ratio(r["median_s"], m["median_s"]),
        "ratio_torchrun_over_in_memory_to_start": ratio(t["to_start_median_s"],
                                                        m["to_start_median_s"]),
        "snapshot_every": every, "snapshot_overhead_pct": overhead,
        "snapshot_overhead_per_round_pct": [round(100 * x, 2) for x in paired],
        "steady_none_ms": round(1000 * none, 3) if none else None,
        "steady_auto_ms": round(1000 * auto, 3) if auto else None,
        "host_mb_per_rank": host_mb, "shard_mb_per_rank": shard_mb,
        "host_over_shard": round(host_mb / shard_mb, 2) if host_mb and shard_mb else None,
        "checkpoint_every": 20,
    })


if __name__ == "__main__":
    main()
