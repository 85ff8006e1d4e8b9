"""An unmodified Hugging Face Trainer job, from a worker's SIGKILL to its first resumed step:
torchrun, `unbroken run` without the integration, and `unbroken run` with it, side by side.

Each arm runs examples/hf_trainer/train.py (a tiny GPT-2 the script builds, 2 workers, DDP
over gloo, the Trainer's own checkpoint every SAVE_STEPS steps) with `--step-sleep 0.05`:
each step waits 50 ms in a callback, as GPU time would leave the CPU idle (and a spare
warms up on idle CPU only). Arms:

- `torchrun`: `python -m torch.distributed.run --nproc-per-node 2 --max-restarts 3
  --standalone`, the script with `--resume` (it resumes from its newest checkpoint); by
  default with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (`--torchrun-store worker`), without
  which its restarts of a gloo job mostly fail (`--torchrun-store agent` shows that);
- `restart`: `unbroken run --nproc-per-node 2 --max-restarts 3 --no-integrations`, with
  `--resume`: every worker restarted, the script starting over;
- `in_place`: `unbroken run --nproc-per-node 2 --spares 1 --max-restarts 3`: the Trainer
  integration; the survivor keeps its process and the spare takes rank 1. The kill waits
  for the spare's `spare_ready` (source "worker").

Neither torchrun nor a script without the integration reports steps, so every arm is timed
from the same place: the script's `--step-log`, where rank 0 appends "<global_step> <wall
time>" at each step's end, before the step's sleep. Once rank 0 has logged a step at or past
KILL_AT (between the checkpoints of steps 20 and 30), and while it sleeps after that step
(the line is at most FRESH_S old), rank 1 is SIGKILLed: no step that rank 1 had a part in
can end after the kill. The figure is the time from the kill to the first line logged after
it; steps redone are the step indices logged more than once. A try ends a few steps past
the step the kill interrupted. Tries alternate between the arms.

    .venv/bin/python benchmarks/frameworks.py --tries 10

The last line printed is one JSON object with each arm's figures (ArmStats, plus
`steps_redone_max`, `restarts` and, in place, `spare_promoted`) and the ratios.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness import (
    REPO,
    ArmStats,
    EventTail,
    Try,
    alternate,
    emit,
    events_of,
    kill_everything,
    launch,
    ratio,
    temp_root,
    unbroken_cmd,
)

sys.path.insert(0, str(REPO / "src"))

SCRIPT = REPO / "examples" / "hf_trainer" / "train.py"
ARMS = ["torchrun", "restart", "in_place"]
KILL_AT = 25  # between the Trainer's checkpoints of steps 20 and 30
SAVE_STEPS = 10
STEPS = 600  # never reached: a try ends a few steps after the recovery
STEP_SLEEP = "0.05"
FRESH_S = 0.02  # the kill lands while rank 0 sleeps after a step it logged this recently
PAST = 3  # a try ends once the job logs this many steps past the last one before the kill
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
# torchrun's error line for each failed round of its workers (a restart follows each while
# its budget lasts; its own "will restart" line is logged at INFO, which it does not show)
TORCHRUN_FAILED = "] failed (exitcode:"


@dataclass
class FrameworkTry(Try):
    """A try, and: `restarts`, full restarts the launcher made (torchrun's: the failed rounds
    of workers it logged; unbroken's: its `restart` events); `resumed_at`, the first step logged after the kill;
    `killed_after`, the last step logged before it; in place, whether a spare was promoted."""

    restarts: int | None = None
    resumed_at: int | None = None
    killed_after: int | None = None
    spare_promoted: bool | None = None

    def shown(self) -> str:
        text = super().shown()
        if self.resumed_at is not None:
            text += f", killed after step {self.killed_after}, resumed at {self.resumed_at}"
        if self.restarts is not None:
            text += f", {self.restarts} restart(s)"
        if self.spare_promoted is not None:
            text += f", spare promoted: {self.spare_promoted}"
        return text


# ------------------------------------------------------------------------------ the step log
def read_log(path: Path) -> list[tuple[int, float]]:
    """The step log's (step, time) lines in order; a torn last line (mid-write) is skipped."""
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                rows.append((int(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return rows


def steps_redone(rows: list[tuple[int, float]]) -> int:
    """How many step indices were logged more than once."""
    return sum(1 for count in Counter(step for step, _ in rows).values() if count > 1)


def first_after(rows: list[tuple[int, float]], t: float) -> tuple[int, float] | None:
    """The first line logged after wall time `t`, or None."""
    return next((row for row in rows if row[1] > t), None)


# ------------------------------------------------------------------------------ arms
def command(arm: str, run_dir: Path) -> list[str]:
    args = ["--output-dir", str(run_dir / "out"), "--steps", str(STEPS), "--save-steps",
            str(SAVE_STEPS), "--step-sleep", STEP_SLEEP, "--step-log", str(run_dir / "steps.log")]
    if arm == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--max-restarts", "3", "--standalone", str(SCRIPT), *args, "--resume"]
    if arm == "restart":
        return unbroken_cmd(2, run_dir, SCRIPT, *args, "--resume", flags=["--no-integrations"])
    return unbroken_cmd(2, run_dir, SCRIPT, *args, flags=["--spares", "1"])


def _environ(pid: str) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(entry.decode(errors="replace").split("=", 1)
                for entry in raw.split(b"\0") if b"=" in entry)


def torchrun_rank(run_dir: Path, rank: int) -> int | None:
    """The pid of torchrun's worker of `rank` (RANK in its environment) for this run dir."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            env = _environ(entry.name)
            if env.get("UNBROKEN_RUN_DIR") == str(run_dir) and env.get("RANK") == str(rank) \
                    and "TORCHELASTIC_RUN_ID" in env:
                return int(entry.name)
    return None


def victim_of(arm: str, run_dir: Path, tail: EventTail) -> int | None:
    """Rank 1's pid: torchrun's from /proc, unbroken's from its `workers_started` event."""
    if arm == "torchrun":
        return torchrun_rank(run_dir, 1)
    started = [e for e in tail.events if e["event"] == "workers_started" and "1" in e["pids"]]
    return started[-1]["pids"]["1"] if started else None


def spare_ready(events: list[dict]) -> bool:
    return any(e["event"] == "spare_ready" and e.get("source") == "worker" for e in events)


def _restarts(arm: str, run_dir: Path) -> int:
    if arm == "torchrun":
        log = (run_dir / "launcher.log").read_text(errors="replace")
        return log.count(TORCHRUN_FAILED)
    return sum(1 for e in events_of(run_dir) if e["event"] == "restart")


# ------------------------------------------------------------------------------ one try
def _wait(until: Callable[[], object], proc: subprocess.Popen, timeout: float,
          every: float = 0.005) -> object:
    """`until()`'s first truthy value within `timeout` s; None on timeout or once the
    launcher has exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = until()
        if value:
            return value
        if proc.poll() is not None:
            return None
        time.sleep(every)
    return None


def environment(arm: str, torchrun_store: str) -> dict[str, str]:
    """The arm's extra environment. torchrun's workers host their own store under
    `torchrun_store="worker"` (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with the agent's shared
    store, its restarts of a gloo job mostly fail (benchmarks/README.md, restart.py)."""
    env = dict(ENV)
    if arm == "torchrun" and torchrun_store == "worker":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def one_try(arm: str, root: Path, index: int, hang_after: float,
            torchrun_store: str = "worker") -> FrameworkTry:
    run_dir = root / f"{arm}-{index}"
    log, tail = run_dir / "steps.log", EventTail(run_dir)
    proc = launch(command(arm, run_dir), run_dir, env=environment(arm, torchrun_store))
    try:
        def ready() -> bool:
            tail.poll()
            return arm != "in_place" or spare_ready(tail.events)

        if not _wait(ready, proc, 300, every=0.05):
            return FrameworkTry(arm, error="the spare never got ready")

        def fresh_line() -> tuple[int, float] | None:
            rows = read_log(log)
            if rows and rows[-1][0] >= KILL_AT and time.time() - rows[-1][1] <= FRESH_S:
                return rows[-1]
            return None

        last = _wait(fresh_line, proc, 300)
        tail.poll()
        victim = victim_of(arm, run_dir, tail)
        if not last or victim is None:
            return FrameworkTry(arm, error="never reached the kill step")
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        resumed = _wait(lambda: first_after(read_log(log), killed_at), proc, hang_after)
        if resumed is None:
            exited = proc.poll()
            return FrameworkTry(arm, hang=exited is None, restarts=_restarts(arm, run_dir),
                                error=None if exited is None else f"exited {exited} without resuming")
        _wait(lambda: max(step for step, _ in read_log(log)) >= last[0] + PAST, proc, 30)
        rows = read_log(log)
        events = events_of(run_dir) if arm == "in_place" else []
        return FrameworkTry(arm, recovery=resumed[1] - killed_at, lost_steps=steps_redone(rows),
                            restarts=_restarts(arm, run_dir), resumed_at=resumed[0],
                            killed_after=last[0],
                            spare_promoted=any(e["event"] == "spare_promoted" for e in events)
                            if arm == "in_place" else None)
    finally:
        kill_everything(proc, run_dir)


def summary_of(tries: list[FrameworkTry]) -> dict:
    stats = ArmStats.of(tries).as_json()
    stats["steps_redone_max"] = stats["lost_steps_max"]
    stats["restarts"] = [t.restarts for t in tries]
    if any(t.spare_promoted is not None for t in tries):
        stats["spare_promoted"] = sum(1 for t in tries if t.spare_promoted)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tries", type=int, default=10, help="faults per arm")
    p.add_argument("--hang-after", type=float, default=90.0,
                   help="seconds after the kill with no resumed step: a hang")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--torchrun-store", choices=["worker", "agent"], default="worker",
                   help="worker (default): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, rank 0 hosts "
                        "the store, as torchrun's restarts of a gloo job need; agent: torchrun's "
                        "shared store, as documented")
    args = p.parse_args()
    root = temp_root("unbroken-bench-frameworks-", keep=args.keep)

    def show(i: int, arm: str, r: FrameworkTry) -> None:
        print(f"try {i + 1:2d} {arm:9s} kill-to-resumed-step {r.shown()}", flush=True)

    results = alternate(ARMS, args.tries, lambda arm, i: one_try(arm, root, i, args.hang_after,
                                                           args.torchrun_store),
                        report=show)
    summary = {arm: summary_of(rs) for arm, rs in results.items()}
    t, r, u = (summary[arm]["median_s"] for arm in ARMS)
    print()
    for arm, st in summary.items():
        print(f"{arm:9s} median {st['median_s']}s  p90 {st['p90_s']}s  steps redone max "
              f"{st['steps_redone_max']}  hangs {st['hangs']}/{st['tries']}  failed {st['failed']}"
              f"  restarts {st['restarts']}")
    print(f"torchrun / in place: {ratio(t, u)}x;  restart / in place: {ratio(r, u)}x;  "
          f"torchrun / restart: {ratio(t, r, 2)}x")
    if args.keep:
        print(f"run directories kept in {root}")
    emit({"benchmark": "frameworks", "workers": 2, "spares_in_place": 1, "kill_at_step": KILL_AT,
          "save_steps": SAVE_STEPS, "step_sleep_s": float(STEP_SLEEP),
          "torchrun_store": args.torchrun_store, **summary,
          "ratio_median_torchrun_over_in_place": ratio(t, u),
          "ratio_median_restart_over_in_place": ratio(r, u),
          "ratio_median_torchrun_over_restart": ratio(t, r, 2)})


if __name__ == "__main__":
    main()
