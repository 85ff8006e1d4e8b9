"""Kill-to-first-resumed-step: `torchrun` against `unbroken run`, side by side in one run.

Both unbroken launchers run with `--on-fault restart` (every worker restarted from the last
checkpoint); in-place recovery is `benchmarks/recovery.py`. `unbroken` forks the restarted
workers from the node's fork server; `unbroken-cold` adds `--no-fork-server` (its old name,
`--no-warm-restarts`, is what the command line says): a full cold restart (every worker
re-imports torch), which is what any restart-everything launcher pays at best.

Three launchers run the same example (examples/gpt/train.py, 4 workers, DDP over gloo,
checkpoint every 10 steps) with --max-restarts. Once training passes step KILL_AT, the
benchmark SIGKILLs rank 1 from outside and measures the time from the kill to the first
step completed by the restarted job. A try with no resumed step within --hang-after
seconds is a hang. Tries alternate between the launchers so that machine noise hits both.

    .venv/bin/python benchmarks/restart.py --tries 10

`plain_heavy` case (`--case plain_heavy` runs it alone; `--case gpt` only the above): a plain
torchrun-style script with no unbroken API and heavy imports (`benchmarks/plain_heavy.py`:
transformers where installed), 2 workers, its own checkpoint every 10 steps, each step
waiting --plain-step-sleep s (standing in for accelerator time, as in spares.py). Once it
passes step PLAIN_KILL_AT (~20 s in: the warm interpreters have imported torch and what the
workers imported), rank 1 is SIGKILLed from outside; the figure is the time from the kill to
the first step the restarted script completes (from the step log it writes under both
launchers), for `unbroken run --on-fault restart` against torchrun (same flags as above; by
default with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the only way its restart of a plain gloo
script succeeds at the first try here: see --plain-torchrun-store). `--plain-control` adds
`unbroken-torch-only`: warm interpreters that import torch only, as before they imported what
the workers had (the node's module list is blocked: a directory stands at its path).

    .venv/bin/python benchmarks/restart.py --case plain_heavy --tries 5

The last line printed is one JSON object with the figures and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness import (
    EXAMPLE,
    REPO,
    ArmStats,
    Try,
    alternate,
    emit,
    events_of,
    kill_everything,
    launch,
    median_of,
    ratio,
    recovery_times,
    temp_root,
    torchrun_cmd,
    unbroken_cmd,
    wait_or_kill,
)

PLAIN_HEAVY = REPO / "benchmarks" / "plain_heavy.py"
sys.path.insert(0, str(REPO / "src"))

from unbroken.runtime.warm_imports import modules_path  # noqa: E402

# Killed in steady state (a few seconds into training), as real faults mostly are.
KILL_AT = 120
STEPS = 140
# The plain script: ~20 s into training, past the 10 s after which the agent fills its pool
# for a script that sends no heartbeats, and the warm interpreters' imports (~6 s at idle priority).
PLAIN_KILL_AT = 300
PLAIN_STEPS = 340
TORCHRUN_RDZV = "c10d"


@dataclass
class RestartTry(Try):
    """A try, and: `restart_failed` (the launcher gave up: every restart failed); the
    restarted workers' mean start-up (s); the attempt the first resumed step belongs to;
    for the plain script under unbroken, the warm interpreters (`standby_*` events) that had
    caught up with the workers' module list at the kill and the modules each taken one had
    pre-imported."""

    restart_failed: bool = False
    startup: float | None = None
    resumed_in_attempt: int | None = None
    warm_standbys_at_kill: int | None = None
    preimported: list | None = None


def _command(launcher: str, run_dir: Path, workers: int) -> list[str]:
    args = ["--steps", str(STEPS), "--checkpoint-dir", str(run_dir / "ckpt"),
            "--checkpoint-every", "10", "--print-every", "1000"]
    if launcher == "torchrun":
        return torchrun_cmd(workers, EXAMPLE, run_dir.name, *args, rdzv_backend=TORCHRUN_RDZV)
    cold = ["--no-warm-restarts"] if launcher == "unbroken-cold" else []
    # Full restarts only: in-place recovery is measured by benchmarks/recovery.py.
    return unbroken_cmd(workers, run_dir, EXAMPLE, *args, flags=["--on-fault", "restart", *cold])


def _kill_and_wait(launcher: str, proc: subprocess.Popen, run_dir: Path, victim: int,
                   hang_after: float, first_resumed: Callable[[float], dict | None],
                   ) -> tuple[float, dict, int] | RestartTry:
    """SIGKILL `victim`, then wait for `first_resumed(killed_at)` (the first step of a later
    attempt) and for the launcher's exit. Returns (killed_at, that step, exit code), or the
    failed try (a hang, or every restart failed)."""
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    resumed = None
    deadline = time.monotonic() + hang_after
    while time.monotonic() < deadline:
        resumed = first_resumed(killed_at)
        if resumed or proc.poll() is not None:
            break
        time.sleep(0.01)
    if resumed is None:
        code = proc.poll()
        kill_everything(proc, run_dir)
        if code is not None:  # gave up: every restart failed
            return RestartTry(launcher, exit=code, restart_failed=True)
        return RestartTry(launcher, hang=True)
    code = wait_or_kill(proc, run_dir, 120)
    if code is None:
        return RestartTry(launcher, hang=True, recovery=resumed["t"] - killed_at)
    return killed_at, resumed, code


def one_try(launcher: str, root: Path, index: int, workers: int, hang_after: float) -> RestartTry:
    run_dir = root / f"{launcher}-{index}"
    proc = launch(_command(launcher, run_dir, workers), run_dir)
    try:
        deadline = time.monotonic() + 180
        victim = None
        while time.monotonic() < deadline and victim is None:
            evs = events_of(run_dir)
            if any(e["event"] == "step" and e["step"] >= KILL_AT for e in evs):
                victim = next(e["pid"] for e in evs if e["event"] == "worker_start" and e["rank"] == 1)
            elif proc.poll() is not None:
                break
            time.sleep(0.02)
        if victim is None:
            return RestartTry(launcher, error="never reached the kill step")
        done = _kill_and_wait(
            launcher, proc, run_dir, victim, hang_after,
            lambda t: next((e for e in events_of(run_dir) if e["event"] == "step"
                            and e["attempt"] >= 1 and e["t"] > t), None))
        if isinstance(done, RestartTry):
            return done
        killed_at, resumed, code = done
        evs = events_of(run_dir)
        startup = [e["startup"] for e in evs if e["event"] == "worker_start" and e["attempt"] >= 1
                   and e.get("startup")]
        return RestartTry(launcher, exit=code, recovery=resumed["t"] - killed_at,
                          startup=statistics.fmean(startup) if startup else None,
                          finished=max((e["step"] for e in evs if e["event"] == "step"),
                                       default=-1) + 1 == STEPS)
    finally:
        kill_everything(proc, run_dir)


def _stats(results: list[RestartTry]) -> dict:
    """An arm's figures: ArmStats's counts, the median and max recovery, restarts failed,
    and the restarted workers' median start-up."""
    stats = ArmStats.of(results)
    times = recovery_times(results)
    return {
        "tries": stats.tries,
        "median_s": stats.median_s,
        "max_s": round(max(times), 3) if times else None,
        "hangs": stats.hangs,
        "restarts_failed": sum(1 for r in results if r.restart_failed),
        "failed": stats.failed,
        "restart_startup_s": median_of([r.startup for r in results if r.startup], 3),
    }


def _read_steps(path: Path) -> list[dict]:
    """The plain script's step log (a torn last line, mid-write, is skipped)."""
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _plain_command(launcher: str, run_dir: Path, workers: int, step_sleep: float) -> list[str]:
    args = ["--out", str(run_dir / "out"), "--steps", str(PLAIN_STEPS),
            "--step-sleep", str(step_sleep)]
    if launcher == "torchrun":
        return torchrun_cmd(workers, PLAIN_HEAVY, run_dir.name, *args, rdzv_backend=TORCHRUN_RDZV)
    return unbroken_cmd(workers, run_dir, PLAIN_HEAVY, *args,
                        flags=["--on-fault", "restart"])  # unbroken and unbroken-torch-only


PLAIN_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def plain_try(launcher: str, root: Path, index: int, workers: int, hang_after: float,
              step_sleep: float, torchrun_store: str) -> RestartTry:
    """One kill of rank 1 of the plain script, in steady state; kill to first resumed step."""
    run_dir = root / f"plain-{launcher}-{index}"
    out = run_dir / "out"
    out.mkdir(parents=True)
    env = dict(PLAIN_ENV)
    if launcher == "torchrun" and torchrun_store == "worker":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if launcher == "unbroken-torch-only":  # no list can be written or read there
        modules_path(run_dir, 0).mkdir(parents=True)
    steps = out / "steps.jsonl"
    proc = launch(_plain_command(launcher, run_dir, workers, step_sleep), run_dir, env=env)
    try:
        deadline = time.monotonic() + 240
        victim = None
        while time.monotonic() < deadline and victim is None:
            if any(r.get("step", -1) >= PLAIN_KILL_AT for r in _read_steps(steps)):
                victim = int((out / "pid_rank1").read_text())
            elif proc.poll() is not None:
                break
            time.sleep(0.05)
        if victim is None:
            return RestartTry(launcher, error="never reached the kill step")
        # How many warm interpreters had caught up with the workers' module list at the kill.
        warm = (len({e["pid"] for e in events_of(run_dir) if e["event"] == "warm_imports"})
                if launcher.startswith("unbroken") else None)
        done = _kill_and_wait(
            launcher, proc, run_dir, victim, hang_after,
            lambda t: next((r for r in _read_steps(steps) if "step" in r
                            and r["attempt"] >= 1 and r["t"] > t), None))
        if isinstance(done, RestartTry):
            return done
        killed_at, resumed, code = done
        rows = _read_steps(steps)
        taken = [e for e in events_of(run_dir) if e["event"] == "standby_taken"]
        return RestartTry(launcher, exit=code, recovery=resumed["t"] - killed_at,
                          resumed_in_attempt=resumed["attempt"], warm_standbys_at_kill=warm,
                          preimported=[e["modules"] for e in taken] if warm is not None else None,
                          finished=max((r["step"] for r in rows if "step" in r), default=-1) + 1
                          == PLAIN_STEPS)
    finally:
        kill_everything(proc, run_dir)


def _heavy_imports(root: Path) -> dict:
    """What the plain script's imports cost here, torch's apart (one fresh interpreter)."""
    code = ("import json, sys, time\n"
            "t0 = time.perf_counter()\n"
            "import torch, torch.distributed, torch.nn.parallel\n"
            "t1 = time.perf_counter()\n"
            f"sys.path.insert(0, {str(PLAIN_HEAVY.parent)!r})\n"
            "import plain_heavy\n"
            "library, _ = plain_heavy.heavy_model()\n"
            "t2 = time.perf_counter()\n"
            "print('IMPORTS', json.dumps({'library': library, 'torch_import_s': round(t1 - t0, 3),"
            " 'heavy_import_s': round(t2 - t1, 3)}))\n")
    run_dir = root / "imports"
    code_ = wait_or_kill(launch([sys.executable, "-c", code], run_dir, env=PLAIN_ENV), run_dir, 300)
    output = (run_dir / "launcher.log").read_text(errors="replace")
    if code_ != 0:
        raise SystemExit(f"plain_heavy.py's imports failed:\n{output}")
    line = [x for x in output.splitlines() if x.startswith("IMPORTS ")][-1]
    return json.loads(line.removeprefix("IMPORTS "))


def _shown(r: RestartTry) -> str:
    return (f"{r.recovery:.2f}s" if r.recovery is not None and not r.hang else "HANG" if r.hang
            else f"RESTART FAILED (exit {r.exit})" if r.restart_failed else str(r.error))


def _unfinished(r: RestartTry) -> str:
    return "  (did not finish)" if r.finished is False or r.exit not in (0, None) else ""


def run_gpt(args: argparse.Namespace, root: Path) -> dict:
    launchers = ["torchrun", "unbroken-cold", "unbroken"]

    def show(i: int, launcher: str, r: RestartTry) -> None:
        print(f"try {i + 1:2d} {launcher:13s} kill-to-resumed-step {_shown(r)}{_unfinished(r)}",
              flush=True)

    results = alternate(launchers, args.tries,
                        lambda launcher, i: one_try(launcher, root, i, args.workers,
                                                    args.hang_after),
                        report=show)
    summary = {name: _stats(rs) for name, rs in results.items()}
    t, c, u = summary["torchrun"], summary["unbroken-cold"], summary["unbroken"]
    print()
    for name, s in summary.items():
        print(f"{name:13s} median {s['median_s']}s  max {s['max_s']}s  hangs {s['hangs']}/{s['tries']}  "
              f"restarts failed {s['restarts_failed']}/{s['tries']}  "
              f"failed {s['failed']}  worker start-up after restart {s['restart_startup_s']}s")
    print(f"torchrun / unbroken (median kill-to-resumed-step): {ratio(t['median_s'], u['median_s'], 2)}x"
          + ("  (torchrun never resumed)" if t["median_s"] is None else ""))
    print(f"unbroken cold / warm restart: {ratio(c['median_s'], u['median_s'], 2)}x")
    return {"workers": args.workers, "torchrun_rdzv": args.torchrun_rdzv, **summary,
            "ratio_median_torchrun_over_unbroken": ratio(t["median_s"], u["median_s"], 2),
            "ratio_median_cold_over_warm": ratio(c["median_s"], u["median_s"], 2)}


def run_plain_heavy(args: argparse.Namespace, root: Path) -> dict:
    imports = _heavy_imports(root)
    print(f"plain_heavy: {imports['library']} takes {imports['heavy_import_s']:.2f}s to import "
          f"(and build its model) after torch's {imports['torch_import_s']:.2f}s", flush=True)
    launchers = ["torchrun", "unbroken", *(["unbroken-torch-only"] if args.plain_control else [])]

    def show(i: int, launcher: str, r: RestartTry) -> None:
        extra = (f"  resumed in attempt {r.resumed_in_attempt}"
                 if (r.resumed_in_attempt or 1) > 1 else "")
        if r.warm_standbys_at_kill is not None:
            extra += (f"  standbys caught up at the kill {r.warm_standbys_at_kill}"
                      f"/{args.plain_workers}, modules pre-imported {r.preimported}")
        print(f"try {i + 1:2d} plain_heavy {launcher:19s} kill-to-resumed-step {_shown(r)}"
              f"{_unfinished(r)}{extra}", flush=True)

    results = alternate(launchers, args.tries,
                        lambda launcher, i: plain_try(launcher, root, i, args.plain_workers,
                                                      args.hang_after, args.plain_step_sleep,
                                                      args.plain_torchrun_store),
                        report=show)
    summary = {}
    for name, rs in results.items():
        stats = _stats(rs)
        del stats["restart_startup_s"]  # the plain script reports no start-up
        stats["resumed_in_later_attempt"] = sum(1 for r in rs if (r.resumed_in_attempt or 1) > 1)
        summary[name] = stats
    t, u = summary["torchrun"]["median_s"], summary["unbroken"]["median_s"]
    print()
    for name, s in summary.items():
        print(f"plain_heavy {name:19s} median {s['median_s']}s  max {s['max_s']}s  "
              f"hangs {s['hangs']}/{s['tries']}  restarts failed {s['restarts_failed']}/{s['tries']}  "
              f"failed {s['failed']}  resumed only after a failed restart {s['resumed_in_later_attempt']}")
    over = ratio(t, u, 2)
    print(f"plain_heavy torchrun / unbroken (median kill-to-resumed-step): {over}x"
          + (f"  (unbroken takes {ratio(u, t, 2)}x torchrun's time; target <= 0.5x)" if over else ""))
    control = {}
    if args.plain_control:
        control["ratio_plain_heavy_torch_only_over_unbroken"] = ratio(
            summary["unbroken-torch-only"]["median_s"], u, 2)
        print("plain_heavy standbys importing torch only / also the workers' modules: "
              f"{control['ratio_plain_heavy_torch_only_over_unbroken']}x")
    return {"plain_heavy": {**imports, "workers": args.plain_workers,
                            "step_sleep_s": args.plain_step_sleep, "kill_at_step": PLAIN_KILL_AT,
                            "torchrun_store": args.plain_torchrun_store, **summary},
            "ratio_plain_heavy_torchrun_over_unbroken": over, **control}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=["all", "gpt", "plain_heavy"], default="all",
                   help="gpt: the example under three launchers; plain_heavy: the plain script "
                        "with heavy imports; all (default): both")
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--hang-after", type=float, default=30.0)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--torchrun-rdzv", choices=["c10d", "static"], default="c10d",
                   help="torchrun's rendezvous backend (default c10d, as in torchrun's docs)")
    p.add_argument("--plain-workers", type=int, default=2)
    p.add_argument("--plain-step-sleep", type=float, default=0.05,
                   help="seconds each step of the plain script waits (accelerator time)")
    p.add_argument("--plain-torchrun-store", choices=["worker", "agent"], default="worker",
                   help="worker (default): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, rank 0 hosts a "
                        "fresh store per restart; agent: torchrun's default, one store for "
                        "every restart, where a restarted gloo group may read the dead "
                        "workers' addresses and fail (another restart then follows)")
    p.add_argument("--plain-control", action="store_true",
                   help="plain_heavy: also run unbroken with warm interpreters that import torch only")
    args = p.parse_args()
    global TORCHRUN_RDZV
    TORCHRUN_RDZV = args.torchrun_rdzv
    root = temp_root("unbroken-bench-restart-", keep=args.keep)
    figures: dict = {}
    if args.case in ("all", "gpt"):
        figures.update(run_gpt(args, root))
    if args.case in ("all", "plain_heavy"):
        if figures:
            print()
        figures.update(run_plain_heavy(args, root))
    if args.keep:
        print(f"run directories kept in {root}")
    emit({"benchmark": "restart", "case": args.case, **figures})


if __name__ == "__main__":
    main()
