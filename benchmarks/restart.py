"""Kill-to-first-resumed-step: `torchrun` against `unbroken run`, side by side in one run.

Both unbroken launchers run with `--on-fault restart` (every worker restarted from the last
checkpoint); in-place recovery is `benchmarks/recovery.py`. `unbroken-cold` adds
`--no-warm-restarts`: a full cold restart (every worker re-imports torch), which is what any
restart-everything launcher pays at best.

Three launchers run the same example (examples/gpt/train.py, 4 workers, DDP over gloo,
checkpoint every 10 steps) with --max-restarts. Once training passes step KILL_AT, the
benchmark SIGKILLs rank 1 from outside and measures the time from the kill to the first
step completed by the restarted job. A try with no resumed step within --hang-after
seconds is a hang. Tries alternate between the launchers so that machine noise hits both.

    .venv/bin/python benchmarks/restart.py --tries 10

The last line printed is one JSON object with the figures and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt" / "train.py"
sys.path.insert(0, str(REPO / "src"))

from harness import free_port, kill_everything  # noqa: E402

from unbroken.telemetry.events import read_events  # noqa: E402

# Killed in steady state (a few seconds into training), as real faults mostly are.
KILL_AT = 120
STEPS = 140


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return read_events(path) if path.exists() else []


TORCHRUN_RDZV = "c10d"


def _command(launcher: str, run_dir: Path, workers: int) -> list[str]:
    args = ["--steps", str(STEPS), "--checkpoint-dir", str(run_dir / "ckpt"),
            "--checkpoint-every", "10", "--print-every", "1000"]
    if launcher == "torchrun":
        port = free_port()
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers),
                "--max-restarts", "3", "--rdzv-backend", TORCHRUN_RDZV,
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_dir.name,
                "--monitor-interval", "0.1", str(EXAMPLE), *args]
    cold = ["--no-warm-restarts"] if launcher == "unbroken-cold" else []
    # Full restarts only: in-place recovery is measured by benchmarks/recovery.py.
    return [sys.executable, "-m", "unbroken", "run", "--standalone", "--nproc-per-node", str(workers),
            "--max-restarts", "3", "--on-fault", "restart", "--run-dir", str(run_dir), *cold,
            str(EXAMPLE), *args]


def one_try(launcher: str, root: Path, index: int, workers: int, hang_after: float) -> dict:
    run_dir = root / f"{launcher}-{index}"
    run_dir.mkdir(parents=True)
    env = {**os.environ, "UNBROKEN_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1"}
    with open(run_dir / "launcher.log", "wb") as log:
        proc = subprocess.Popen(_command(launcher, run_dir, workers), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        victim = None
        while time.monotonic() < deadline and victim is None:
            evs = _events(run_dir)
            if any(e["event"] == "step" and e["step"] >= KILL_AT for e in evs):
                victim = next(e["pid"] for e in evs if e["event"] == "worker_start" and e["rank"] == 1)
            elif proc.poll() is not None:
                break
            time.sleep(0.02)
        if victim is None:
            kill_everything(proc, run_dir)
            return {"launcher": launcher, "error": "never reached the kill step"}
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        resumed = None
        deadline = time.monotonic() + hang_after
        while time.monotonic() < deadline:
            evs = _events(run_dir)
            resumed = next((e for e in evs if e["event"] == "step" and e["attempt"] >= 1
                            and e["t"] > killed_at), None)
            if resumed or proc.poll() is not None:
                break
            time.sleep(0.01)
        if resumed is None:
            code = proc.poll()
            kill_everything(proc, run_dir)
            if code is not None:  # gave up: every restart failed
                return {"launcher": launcher, "hang": False, "exit": code, "restart_failed": True}
            return {"launcher": launcher, "hang": True}
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_everything(proc, run_dir)
            return {"launcher": launcher, "hang": True, "recovery": resumed["t"] - killed_at}
        evs = _events(run_dir)
        startup = [e["startup"] for e in evs if e["event"] == "worker_start" and e["attempt"] >= 1
                   and e.get("startup")]
        return {"launcher": launcher, "hang": False, "exit": code,
                "recovery": resumed["t"] - killed_at,
                "startup": statistics.fmean(startup) if startup else None,
                "finished": max((e["step"] for e in evs if e["event"] == "step"), default=-1) + 1 == STEPS}
    finally:
        if proc.poll() is None:
            kill_everything(proc, run_dir)


def _stats(results: list[dict]) -> dict:
    times = [r["recovery"] for r in results if not r.get("hang") and "recovery" in r]
    return {
        "tries": len(results),
        "median_s": round(statistics.median(times), 3) if times else None,
        "max_s": round(max(times), 3) if times else None,
        "hangs": sum(1 for r in results if r.get("hang")),
        "restarts_failed": sum(1 for r in results if r.get("restart_failed")),
        "failed": sum(1 for r in results if "error" in r or r.get("exit") not in (0, None)
                      or r.get("finished") is False),
        "restart_startup_s": round(statistics.median([r["startup"] for r in results if r.get("startup")]), 3)
        if any(r.get("startup") for r in results) else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--hang-after", type=float, default=30.0)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--torchrun-rdzv", choices=["c10d", "static"], default="c10d",
                   help="torchrun's rendezvous backend (default c10d, as in torchrun's docs)")
    args = p.parse_args()
    global TORCHRUN_RDZV
    TORCHRUN_RDZV = args.torchrun_rdzv
    root = Path(tempfile.mkdtemp(prefix="unbroken-bench-restart-"))
    launchers = ["torchrun", "unbroken-cold", "unbroken"]
    results: dict[str, list[dict]] = {name: [] for name in launchers}
    for i in range(args.tries):
        for launcher in launchers if i % 2 == 0 else launchers[::-1]:
            r = one_try(launcher, root, i, args.workers, args.hang_after)
            results[launcher].append(r)
            shown = (f"{r['recovery']:.2f}s" if "recovery" in r else "HANG" if r.get("hang")
                     else f"RESTART FAILED (exit {r['exit']})" if r.get("restart_failed") else r.get("error"))
            print(f"try {i + 1:2d} {launcher:13s} kill-to-resumed-step {shown}"
                  f"{'  (did not finish)' if r.get('finished') is False or r.get('exit') not in (0, None) else ''}",
                  flush=True)
    summary = {name: _stats(rs) for name, rs in results.items()}
    t, c, u = summary["torchrun"], summary["unbroken-cold"], summary["unbroken"]
    print()
    for name, s in summary.items():
        print(f"{name:13s} median {s['median_s']}s  max {s['max_s']}s  hangs {s['hangs']}/{s['tries']}  "
              f"restarts failed {s['restarts_failed']}/{s['tries']}  "
              f"failed {s['failed']}  worker start-up after restart {s['restart_startup_s']}s")
    def ratio(a: dict, b: dict) -> float | None:
        return round(a["median_s"] / b["median_s"], 2) if a["median_s"] and b["median_s"] else None

    print(f"torchrun / unbroken (median kill-to-resumed-step): {ratio(t, u)}x"
          + ("  (torchrun never resumed)" if t["median_s"] is None else ""))
    print(f"unbroken cold / warm restart: {ratio(c, u)}x")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"benchmark": "restart", "workers": args.workers,
                      "torchrun_rdzv": args.torchrun_rdzv, **summary,
                      "ratio_median_torchrun_over_unbroken": ratio(t, u),
                      "ratio_median_cold_over_warm": ratio(c, u)}))


if __name__ == "__main__":
    main()
