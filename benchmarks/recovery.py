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
checkpoint, from warm standbys), `unbroken` (`unbroken run`: survivors recover in place).
Tries alternate between the arms so machine noise hits all of them.

Steady state: the same step as a plain DDP loop (benchmarks/plain_ddp.py under torchrun)
against the example under `unbroken run` with no faults and no checkpoints, alternating
rounds; the figure is the median wall time between consecutive steps of rank 0, once the
warm standbys are ready (their start-up is a transient, not a steady-state cost).

    .venv/bin/python benchmarks/recovery.py --tries 10

The last line printed is one JSON object with the figures and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt" / "train.py"
PLAIN = REPO / "benchmarks" / "plain_ddp.py"
sys.path.insert(0, str(REPO / "src"))

from harness import (  # noqa: E402
    EventTail,
    free_port,
    kill_and_time,
    kill_everything,
    step_period,
    wait_for_victim,
)

from unbroken.telemetry.events import read_events  # noqa: E402

# Steady state, a few seconds into training, and mid-way between two checkpoints (every 10
# steps), where a fault lands on average.
KILL_AT = 125
STEPS = 160
ARMS = ["torchrun", "unbroken-restart", "unbroken"]


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return read_events(path) if path.exists() else []


def _torchrun(workers: int, script: Path, run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers),
            "--max-restarts", "3", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_dir.name,
            "--monitor-interval", "0.1", str(script), *args]


def _command(arm: str, run_dir: Path, workers: int, steps: int, checkpoints: bool) -> list[str]:
    args = ["--steps", str(steps), "--print-every", "100000"]
    if checkpoints:
        args += ["--checkpoint-dir", str(run_dir / "ckpt"), "--checkpoint-every", "10"]
    if arm == "torchrun":
        return _torchrun(workers, EXAMPLE, run_dir, *args)
    policy = ["--on-fault", "restart"] if arm == "unbroken-restart" else []
    return [sys.executable, "-m", "unbroken", "run", "--standalone", "--nproc-per-node", str(workers),
            "--max-restarts", "3", "--run-dir", str(run_dir), *policy, str(EXAMPLE), *args]


def _launch(cmd: list[str], run_dir: Path) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "UNBROKEN_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1"}
    with open(run_dir / "launcher.log", "ab") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=REPO)


def one_fault(arm: str, root: Path, index: int, workers: int, hang_after: float) -> dict:
    run_dir = root / f"{arm}-{index}"
    proc = _launch(_command(arm, run_dir, workers, STEPS, checkpoints=True), run_dir)
    tail = EventTail(run_dir)
    try:
        victim = wait_for_victim(proc, tail, KILL_AT, rank=1, timeout=180)
        if victim is None:
            return {"arm": arm, "error": "never reached the kill step"}
        killed_at, resumed = kill_and_time(proc, tail, victim, hang_after)
        if isinstance(resumed, str):
            return {"arm": arm, "error": resumed}
        if resumed is None:
            return {"arm": arm, "hang": True}
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            return {"arm": arm, "hang": True, "recovery": resumed["t"] - killed_at}
        steps = [e for e in _events(run_dir) if e["event"] == "step"]
        committed = max((e["step"] for e in steps if e["t"] <= killed_at), default=-1)
        return {"arm": arm, "exit": code, "recovery": resumed["t"] - killed_at,
                "lost_steps": max(0, committed + 1 - resumed["step"]),
                "finished": code == 0 and max(e["step"] for e in steps) + 1 == STEPS}
    finally:
        if proc.poll() is None:
            kill_everything(proc, run_dir)


def steady_step_time(kind: str, root: Path, index: int, workers: int, steps: int,
                     warmup: int) -> float | None:
    """Median seconds between consecutive steps of rank 0, after `warmup` steps."""
    run_dir = root / f"steady-{kind}-{index}"
    if kind == "plain":
        log = run_dir / "steps.jsonl"
        run_dir.mkdir(parents=True)
        cmd = _torchrun(workers, PLAIN, run_dir, "--steps", str(steps), "--timing-file", str(log))
    else:
        cmd = _command("unbroken", run_dir, workers, steps, checkpoints=False)
    proc = _launch(cmd, run_dir)
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        kill_everything(proc, run_dir)
        return None
    if kind == "plain":
        if not log.exists():
            return None
        ends = [json.loads(line)["t"] for line in log.read_text().splitlines()][warmup:]
    else:
        evs = _events(run_dir)
        ends = [e["t"] for e in evs if e["event"] == "step" and e["rank"] == 0][warmup:]
        # Steady state begins once the warm standbys have finished importing torch: they do
        # it on idle CPU only, but on 2 cores that is not free (see benchmarks/README.md).
        ready = max((e["t"] for e in evs if e["event"] == "standby_ready"), default=0.0)
        ends = [t for t in ends if t > ready]
    return step_period(ends, least=1)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stats(results: list[dict]) -> dict:
    times = [r["recovery"] for r in results if "recovery" in r and not r.get("hang")]
    lost = [r["lost_steps"] for r in results if "lost_steps" in r]
    return {
        "tries": len(results),
        "median_s": round(statistics.median(times), 3) if times else None,
        "p90_s": round(_pct(times, 0.9), 3) if times else None,
        "lost_steps_median": statistics.median(lost) if lost else None,
        "lost_steps_max": max(lost) if lost else None,
        "hangs": sum(1 for r in results if r.get("hang")),
        "failed": sum(1 for r in results if "error" in r or r.get("finished") is False),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=10, help="faults per arm (at least 10 for the record)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="steady-state rounds per side")
    p.add_argument("--steady-steps", type=int, default=800)
    p.add_argument("--hang-after", type=float, default=30.0)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="unbroken-bench-recovery-"))
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for i in range(args.tries):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
            r = one_fault(arm, root, i, args.workers, args.hang_after)
            results[arm].append(r)
            shown = (f"{r['recovery']:.3f}s, {r['lost_steps']} lost step(s)" if "lost_steps" in r
                     else "HANG" if r.get("hang") else r.get("error"))
            print(f"try {i + 1:2d} {arm:16s} kill-to-resumed-step {shown}"
                  f"{'  (did not finish)' if r.get('finished') is False else ''}", flush=True)
    steady: dict[str, list[float]] = {"plain": [], "unbroken": []}
    for i in range(args.rounds):
        for kind in ("plain", "unbroken") if i % 2 == 0 else ("unbroken", "plain"):
            t = steady_step_time(kind, root, i, args.workers, args.steady_steps, warmup=50)
            if t is not None:
                steady[kind].append(t)
            print(f"steady round {i + 1} {kind:9s} {1000 * t:.2f} ms/step" if t else
                  f"steady round {i + 1} {kind:9s} FAILED", flush=True)
    summary = {arm: _stats(rs) for arm, rs in results.items()}
    plain = statistics.median(steady["plain"]) if steady["plain"] else None
    ours = statistics.median(steady["unbroken"]) if steady["unbroken"] else None
    overhead = round(100 * (ours / plain - 1), 2) if plain and ours else None
    t, r, u = summary["torchrun"], summary["unbroken-restart"], summary["unbroken"]

    def ratio(a: dict, b: dict) -> float | None:
        return round(a["median_s"] / b["median_s"], 1) if a["median_s"] and b["median_s"] else None

    print()
    for arm, s in summary.items():
        print(f"{arm:16s} median {s['median_s']}s  p90 {s['p90_s']}s  lost steps median "
              f"{s['lost_steps_median']} max {s['lost_steps_max']}  hangs {s['hangs']}/{s['tries']}  "
              f"failed {s['failed']}")
    print(f"torchrun / unbroken in place: {ratio(t, u)}x;  unbroken restart / in place: {ratio(r, u)}x")
    if plain and ours:
        print(f"steady state: plain DDP {1000 * plain:.2f} ms/step, unbroken {1000 * ours:.2f} ms/step, "
              f"overhead {overhead:+.2f}%")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"run directories kept in {root}")
    print(json.dumps({
        "benchmark": "recovery", "workers": args.workers, "kill_at_step": KILL_AT, **summary,
        "ratio_median_torchrun_over_in_place": ratio(t, u),
        "ratio_median_restart_over_in_place": ratio(r, u),
        "steady_plain_ms": round(1000 * plain, 3) if plain else None,
        "steady_unbroken_ms": round(1000 * ours, 3) if ours else None,
        "steady_overhead_pct": overhead,
    }))


if __name__ == "__main__":
    main()
