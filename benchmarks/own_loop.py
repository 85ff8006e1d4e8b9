"""A loop of the user's own (examples/custom_loop/train.py, unchanged): a worker's SIGKILL
to the resumed step, in place with a spare against torchrun, side by side; and what
`run.steps(data=...)` with `run.try_step()` costs a step.

Each fault arm runs the example with 4 workers (DDP over gloo, a `DistributedSampler`,
accumulation over 2 micro-batches, a clip, a scheduler), `--step-sleep 0.05` (every step
waits 50 ms, as GPU time would leave the CPU idle) and a checkpoint every 10 steps:

- `torchrun`: `python -m torch.distributed.run --max-restarts 3`: every worker restarts and
  resumes from the newest checkpoint;
- `in_place`: `unbroken run --spares 1`: the survivors keep their processes, the spare
  takes rank 1; the kill waits for `spare_ready`.

Once training passes step KILL_AT, rank 1 is SIGKILLed; the figure is the time from the
kill to the start of the first step the recovered job completes (its event's time less its
duration) and to its end; committed steps computed again are counted from the events.

The cost per step: the example under `unbroken run` (4 workers, no fault, 50 ms sleep) as
written (`own`) against its `--bare` form (the loop as torchrun runs it, same batches), in
interleaved rounds; and in one process the runtime's own time per step (`try_step_us`): a
loop of `run.steps(data=...)` and `run.try_step()` around one optimizer step, against the
same loop over the loader alone.

    .venv/bin/python benchmarks/own_loop.py --tries 5 --rounds 5

The last line printed is one JSON object: `in_place.median_s`, `in_place.redone_max`,
`torchrun.median_s`, `step_overhead_pct`, and the rest.
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
    EventTail,
    Fault,
    Try,
    alternate,
    emit,
    events_of,
    inject_fault,
    kill_everything,
    launch,
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

SCRIPT = REPO / "examples" / "custom_loop" / "train.py"
ARMS = ["torchrun", "in_place"]
KILL_AT = 35
STEPS = 600  # never reached: a try ends a few steps after the recovery
STEP_SLEEP = "0.05"


@dataclass
class LoopTry(Try):
    """A try, and the time from the kill to the resumed step's start."""

    to_start: float | None = None
    promoted: bool = False


def _command(arm: str, run_dir: Path, workers: int, steps: int, *extra: str) -> list[str]:
    args = ["--steps", str(steps), "--print-every", "100000", "--step-sleep", STEP_SLEEP, *extra]
    if arm == "torchrun":
        return torchrun_cmd(workers, SCRIPT, run_dir.name, *args)
    return unbroken_cmd(workers, run_dir, SCRIPT, *args,
                        flags=["--spares", "1"] if arm == "in_place" else [])


def one_fault(arm: str, root: Path, index: int, workers: int, hang_after: float) -> Try:
    run_dir = root / f"{arm}-{index}"
    ckpt = ["--checkpoint-dir", str(run_dir / "ckpt"), "--checkpoint-every", "10"]
    proc = launch(_command(arm, run_dir, workers, STEPS, *ckpt), run_dir)
    try:
        ready = (lambda events: any(e["event"] == "spare_ready" for e in events)) \
            if arm == "in_place" else (lambda events: True)
        fault = inject_fault(arm, proc, EventTail(run_dir), KILL_AT, timeout=240,
                             hang_after=hang_after, ready=ready)
        if not isinstance(fault, Fault):
            return fault
        time.sleep(0.5)
        evs = events_of(run_dir)
        return LoopTry(arm, recovery=fault.resumed["t"] - fault.killed_at,
                       to_start=fault.resumed["t"] - fault.resumed["duration"] - fault.killed_at,
                       lost_steps=redone(evs, fault.killed_at),
                       promoted=any(e["event"] == "spare_promoted" for e in evs))
    finally:
        kill_everything(proc, run_dir)


def redone(events: list[dict], killed_at: float) -> int:
    """Committed steps computed again: steps whose event some rank wrote before the kill and
    that some rank committed again after it."""
    before = {e["step"] for e in events if e["event"] == "step" and e["t"] <= killed_at}
    after = {e["step"] for e in events if e["event"] == "step" and e["t"] > killed_at}
    return len(before & after)


def steady(form: str, root: Path, index: int, workers: int, steps: int) -> float | None:
    """Seconds per step of rank 0, no fault: the example as written (`own`) or `--bare`
    (which writes no step event: both forms are timed from the script's `--step-log`)."""
    run_dir = root / f"steady-{form}-{index}"
    log = run_dir / "steps.log"
    extra = ["--step-log", str(log), *(["--bare"] if form == "bare" else [])]
    proc = launch(_command("unbroken", run_dir, workers, steps, *extra), run_dir)
    if wait_or_kill(proc, run_dir, 600) is None or not log.exists():
        return None
    ends = [float(line.split()[1]) for line in log.read_text().splitlines()]
    return step_period(ends[5:])


def runtime_us(steps: int = 3000) -> tuple[float, float]:
    """In one process: µs per step of `run.steps(data=...)` + `run.try_step()` around one
    optimizer step, and of the same loop over the loader alone (the runtime's own time)."""
    import torch
    from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

    import unbroken

    torch.set_num_threads(1)
    data = TensorDataset(torch.zeros(64, 1))
    loader = DataLoader(data, batch_size=1, sampler=SequentialSampler(data))
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    run = unbroken.init()
    run.track(torch.nn.Linear(1, 1), optimizer)

    def bare() -> float:
        t0, step = time.perf_counter(), 0
        while step < steps:
            for _ in loader:
                weight.grad = torch.zeros(1)
                optimizer.step()
                step += 1
                if step == steps:
                    break
        return time.perf_counter() - t0

    def own() -> list[float]:  # one loop (its hooks are registered once), in 3 segments
        marks = []
        for step, _batch in run.steps(3 * steps, data=loader):
            if step % steps == 0:
                marks.append(time.perf_counter())
            with run.try_step():
                weight.grad = torch.zeros(1)
                optimizer.step()
        marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:], strict=False)]

    b = statistics.median(bare() for _ in range(3))
    o = statistics.median(own())
    run.close()
    return 1e6 * o / steps, 1e6 * b / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=5, help="faults per arm (at least 5)")
    p.add_argument("--rounds", type=int, default=5, help="steady-state rounds per form")
    p.add_argument("--steady-steps", type=int, default=200)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--hang-after", type=float, default=60.0)
    args = p.parse_args()
    root = temp_root("unbroken-bench-own-loop-")

    def show(i: int, arm: str, r: Try) -> None:
        start = f", to the resumed step's start {r.to_start:.3f}s" \
            if isinstance(r, LoopTry) and r.to_start is not None else ""
        print(f"try {i + 1:2d} {arm:9s} kill-to-resumed-step {r.shown()}{start}", flush=True)

    results = alternate(ARMS, args.tries,
                        lambda arm, i: one_fault(arm, root, i, args.workers, args.hang_after),
                        report=show)
    rounds = alternate(["bare", "own"], args.rounds,
                       lambda form, i: steady(form, root, i, args.workers, args.steady_steps),
                       report=lambda i, form, t: print(
                           f"steady round {i + 1} {form:4s} "
                           f"{f'{1000 * t:.2f} ms/step' if t else 'FAILED'}", flush=True))
    own_us, bare_us = runtime_us()

    summary = {}
    for arm, tries in results.items():
        done = [t for t in tries if isinstance(t, LoopTry)]
        summary[arm] = {
            "tries": len(tries), "failed": sum(1 for t in tries if t.failed),
            "hangs": sum(1 for t in tries if t.hang),
            "median_s": median_of([t.recovery for t in done], 3),
            "to_start_median_s": median_of([t.to_start for t in done], 3),
            "max_s": round(max(t.recovery for t in done), 3) if done else None,
            "redone_max": max((t.lost_steps for t in done), default=None),
            "spare_promoted": sum(1 for t in done if t.promoted),
        }
    paired = paired_ratios(rounds["bare"], rounds["own"])
    bare = median_of([t for t in rounds["bare"] if t])
    own = median_of([t for t in rounds["own"] if t])
    overhead = round(100 * statistics.median(paired), 2) if paired else None
    t, i = summary["torchrun"]["median_s"], summary["in_place"]["median_s"]
    print()
    for arm, st in summary.items():
        print(f"{arm:9s} kill to resumed step: median {st['median_s']}s (to its start "
              f"{st['to_start_median_s']}s), max {st['max_s']}s, committed steps redone at most "
              f"{st['redone_max']}, failed {st['failed']}, hangs {st['hangs']}")
    print(f"torchrun / in place: {ratio(t, i)}x")
    print(f"per step: bare {bare and round(1000 * bare, 2)} ms, own loop "
          f"{own and round(1000 * own, 2)} ms: {overhead}% (median of the per-round ratios); "
          f"the runtime's own time {own_us - bare_us:.1f} us a step in one process")
    emit({"benchmark": "own_loop", "workers": args.workers, "kill_at_step": KILL_AT,
          "step_sleep_s": float(STEP_SLEEP), **summary,
          "ratio_median_torchrun_over_in_place": ratio(t, i),
          "steady_bare_ms": round(1000 * bare, 3) if bare else None,
          "steady_own_ms": round(1000 * own, 3) if own else None,
          "step_overhead_pct": overhead,
          "step_overhead_per_round_pct": [round(100 * x, 2) for x in paired],
          "try_step_us": round(own_us - bare_us, 1), "loop_us": round(own_us, 1),
          "bare_loop_us": round(bare_us, 1)})


if __name__ == "__main__":
    main()
