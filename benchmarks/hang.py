"""A hung worker: unbroken's blame-by-progress against torchrun, side by side in one run.

Two simulated nodes (two agents on loopback) run the example with two workers each, DDP over
gloo, 50 ms steps (`--step-sleep 0.05`, standing in for accelerator time). Once training is
steady, one worker (ranks 1, 2, 3 in turn) is SIGSTOPped from outside at a random point of
its step: alive, silent, never progressing, as a stuck kernel or a deadlocked data loader.

- **unbroken**: one job; each try stops a worker, and the figure is the time from the stop
  to the first step the survivors complete in the recovered generation. The next try waits
  until the replacement has joined (world size 4 again) and training is steady. Also
  counted: innocent workers killed (any fault but the stopped worker's) and tries.
- **torchrun**: the same job under `torch.distributed.run` (two agents, c10d rendezvous).
  torchrun has no hang detection: the survivors wait in their collective for the gloo
  timeout. A try counts as recovered if a restarted attempt completes a step within 60 s.
- **jitter**: a separate unbroken job with step times jittered 3-fold (`--step-jitter 3`)
  and no fault: every kill in it is a false kill.

    .venv/bin/python benchmarks/hang.py --tries 10

The last line printed is one JSON object: `unbroken.median_s`, `unbroken.innocent_killed`,
`unbroken.false_kills`, `unbroken.tries`, `torchrun.recovered` (tries recovered within 60 s).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import (
    EXAMPLE,
    REPO,
    EventTail,
    Try,
    emit,
    free_port,
    kill_everything,
    launch,
    median_of,
    recovery_times,
    temp_root,
)

sys.path.insert(0, str(REPO / "src"))

WORKERS_PER_NODE = 2
WORLD = 2 * WORKERS_PER_NODE
TINY = ["--global-batch", "8", "--seq", "32", "--dim", "32", "--layers", "1",
        "--print-every", "100000"]
TORCHRUN_WAIT = 60.0


def _script_args(steps: int, sleep: float, jitter: float = 1.0) -> list[str]:
    return ["--steps", str(steps), *TINY, "--step-sleep", str(sleep),
            "--step-jitter", str(jitter)]


@dataclass
class HangTry(Try):
    """A try, and: the slot stopped, the faults the job recorded for it, how many of them
    were another worker's (innocents killed), and the slots the leader blamed."""

    slot: int | None = None
    faults: int = 0
    innocent: int = 0
    blamed: list[int] = field(default_factory=list)


def _two_unbroken_nodes(run_dir: Path, script_args: list[str]) -> list[subprocess.Popen]:
    port = free_port()
    return [launch([sys.executable, "-m", "unbroken", "run", "--nnodes", "2",
                    "--node-rank", str(node), "--nproc-per-node", str(WORKERS_PER_NODE),
                    "--master-port", str(port), "--rdzv-id", "hang", "--max-restarts", "100",
                    "--quarantine-after", "0",  # every try faults a node: no lemons here
                    "--run-dir", str(run_dir), str(EXAMPLE), *script_args],
                   run_dir, log=f"agent-{node}.log") for node in (0, 1)]


def _stop_all(procs: list[subprocess.Popen], run_dir: Path) -> None:
    for proc in procs:
        kill_everything(proc, run_dir)


def _wait(tail: EventTail, procs: list[subprocess.Popen], what: str, timeout: float, ready):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tail.poll()
        found = ready(tail.events)
        if found:
            return found
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a launcher exited while waiting for {what}")
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


def _steady(events: list[dict], after: float, steps: int = 30) -> bool:
    """The world has its four ranks, and each has completed `steps` steps in that generation
    since `after`."""
    ups = [e for e in events if e["event"] == "gen_up"]
    gen, since = (ups[-1]["gen"], ups[-1]["t"]) if ups else (0, after)
    if ups and ups[-1]["world_size"] != WORLD:
        return False
    done = [e for e in events if e["event"] == "step" and e.get("gen", 0) == gen
            and e["t"] > max(since, after)]
    return all(sum(1 for e in done if e["rank"] == r) >= steps for r in range(WORLD))


def _pid_of(events: list[dict], slot: int) -> int:
    return [e["pid"] for e in events if e["event"] == "worker_start" and e.get("slot") == slot][-1]


def unbroken_hangs(root: Path, tries: int, sleep: float) -> list[HangTry]:
    run_dir = root / "unbroken"
    procs = _two_unbroken_nodes(run_dir, _script_args(10**6, sleep))
    tail = EventTail(run_dir)
    results = []
    try:
        _wait(tail, procs, "steady training", 240, lambda ev: _steady(ev, 0.0))
        for i in range(tries):
            slot = 1 + i % (WORLD - 1)
            victim = _pid_of(tail.events, slot)
            gen = max((e.get("gen", 0) for e in tail.events if e["event"] == "step"), default=0)
            faults_before = sum(1 for e in tail.events if e["event"] == "fault")
            time.sleep(random.uniform(0, sleep))  # a random point of the step
            stopped = time.time()
            os.kill(victim, signal.SIGSTOP)
            resumed = _wait(tail, procs, "the first resumed step", 120,
                            lambda ev, stopped=stopped, gen=gen: next(
                                (e for e in ev if e["event"] == "step" and e["t"] > stopped
                                 and e.get("gen", 0) > gen), None))
            _wait(tail, procs, "the replacement to join", 240,
                  lambda ev, since=resumed["t"]: _steady(ev, since))
            faults = [e for e in tail.events if e["event"] == "fault"][faults_before:]
            results.append(HangTry(
                "unbroken", slot=slot, recovery=resumed["t"] - stopped, faults=len(faults),
                innocent=sum(1 for f in faults if f.get("pid") != victim),
                blamed=[e["slot"] for e in tail.events
                        if e["event"] == "hang_blamed" and e["t"] > stopped]))
            print(f"unbroken try {i + 1}: rank {slot} stopped, first resumed step after "
                  f"{results[-1].recovery:.3f}s, faults {len(faults)}", flush=True)
    finally:
        _stop_all(procs, run_dir)
    return results


def jitter_run(root: Path, steps: int, sleep: float) -> dict:
    run_dir = root / "jitter"
    procs = _two_unbroken_nodes(run_dir, _script_args(steps, sleep, jitter=3.0))
    try:
        codes = [p.wait(timeout=60 + steps * sleep * 10) for p in procs]
    finally:
        _stop_all(procs, run_dir)
    tail = EventTail(run_dir)
    tail.poll()
    kills = [e for e in tail.events if e["event"] in ("fault", "hang_blamed")]
    durations = sorted(e["duration"] for e in tail.events if e["event"] == "step")
    return {"exit": codes, "steps": steps, "false_kills": sum(1 for e in kills
                                                             if e["event"] == "fault"),
            "step_p1_s": durations[len(durations) // 100] if durations else None,
            "step_p99_s": durations[len(durations) * 99 // 100] if durations else None}


def torchrun_hang(root: Path, index: int, sleep: float) -> Try:
    """Two torchrun agents; rank 3 stopped once steady. Recovered (`recovery` set): a
    restart resumes within TORCHRUN_WAIT s."""
    run_dir = root / f"torchrun-{index}"
    port = free_port()
    procs = [launch([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                     "--node-rank", str(node), "--nproc-per-node", str(WORKERS_PER_NODE),
                     "--max-restarts", "3", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"hang{index}",
                     "--monitor-interval", "0.1", str(EXAMPLE), *_script_args(10**6, sleep)],
                    run_dir, log=f"agent-{node}.log") for node in (0, 1)]
    tail = EventTail(run_dir)
    try:
        _wait(tail, procs, "steady training under torchrun", 240, lambda ev: all(
            sum(1 for e in ev if e["event"] == "step" and e["rank"] == r) >= 30
            for r in range(WORLD)))
        victim = _pid_of(tail.events, 3)
        stopped = time.time()
        os.kill(victim, signal.SIGSTOP)
        deadline = time.monotonic() + TORCHRUN_WAIT
        while time.monotonic() < deadline:
            tail.poll()
            resumed = [e for e in tail.events if e["event"] == "step" and e["t"] > stopped
                       and e.get("attempt", 0) > 0]
            if resumed:
                return Try("torchrun", recovery=resumed[0]["t"] - stopped)
            if any(p.poll() is not None for p in procs):
                return Try("torchrun", error="a launcher exited without resuming")
            time.sleep(0.05)
        return Try("torchrun", hang=True)
    finally:
        _stop_all(procs, run_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tries", type=int, default=10, help="hangs under unbroken (median of)")
    p.add_argument("--torchrun-tries", type=int, default=1,
                   help=f"hangs under torchrun; each waits {TORCHRUN_WAIT:g}s for a recovery")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--jitter-steps", type=int, default=1000)
    p.add_argument("--keep", action="store_true", help="keep the run dirs")
    args = p.parse_args()
    root = temp_root("unbroken-hang-", keep=args.keep)
    ours = unbroken_hangs(root, args.tries, args.step_sleep)
    theirs = [torchrun_hang(root, i, args.step_sleep) for i in range(args.torchrun_tries)]
    for i, t in enumerate(theirs):
        print(f"torchrun try {i + 1}: recovered within {TORCHRUN_WAIT:g}s: "
              f"{t.recovery is not None}", flush=True)
    jitter = jitter_run(root, args.jitter_steps, args.step_sleep)
    print(f"jitter run: {jitter}", flush=True)
    if args.keep:
        print(f"run dirs kept in {root}")
    times = recovery_times(ours)
    emit({
        "step_sleep_s": args.step_sleep,
        "unbroken": {
            "tries": len(times),
            "median_s": median_of(times, 3),
            "max_s": round(max(times), 3) if times else None,
            "min_s": round(min(times), 3) if times else None,
            "innocent_killed": sum(t.innocent for t in ours),
            "faults": sum(t.faults for t in ours),
            "false_kills": jitter["false_kills"],
            "jitter_steps": jitter["steps"],
            "jitter_step_p1_s": jitter["step_p1_s"],
            "jitter_step_p99_s": jitter["step_p99_s"],
        },
        "torchrun": {"tries": len(theirs),
                     "recovered": sum(1 for t in theirs if t.recovery is not None)},
    })


if __name__ == "__main__":
    main()
