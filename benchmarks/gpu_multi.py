"""What needs two GPUs or more (shared/reviews/nccl-risks.md, "What needs >= 2 GPUs"), for
the day several are lent: real `unbroken run` jobs on NCCL, one worker per GPU, faults
injected, each scenario's outcome checked.

    PYTHONPATH=src python3 benchmarks/gpu_multi.py              # every scenario the GPUs allow
    PYTHONPATH=src python3 benchmarks/gpu_multi.py --only fence
    PYTHONPATH=src python3 benchmarks/gpu_multi.py --dry-run    # the same jobs on gloo, CPU

Scenarios (GPUs needed):

- `kill` (2): rank 1 SIGKILLed at step 15's start, so rank 0 meets it inside its gradient
  all-reduce: the watchdog aborts the NCCL group, the survivor keeps its process, the
  replacement gets the state over NCCL point-to-point, and the final model and optimizer
  state equal a fault-free run's, bit for bit (`--exact`). Bounded: the switch's time.
- `fence` (2): rank 1 dies at step 12's update point while rank 0 is held there: the
  survivor's update is refused at the fence (its gradients may be partial on NCCL), step 12
  is redone once, bit-identical.
- `never_arrives` (3): rank 1 killed, then rank 2 dies while the new generation forms its
  groups: rank 0's NCCL init with a member that never arrives is bounded (the join
  timeout), the next plan holds, the job ends in place.
- `spare` (3): two workers and a spare on its own GPU; rank 1 killed once the spare has
  warmed up (step 150 of 200), the spare promoted into slot 1 on its own device.
- `hsdp` (4): HSDP 2 x 2 (`fully_shard` on a 2-D mesh: two NCCL groups besides the world's),
  rank 1 killed: both groups aborted, its shard from the live replica, no step lost.

The last line is `{"torch", "gpus", "dry_run", "scenarios": {name: {"result": "pass"|"fail"|
"skipped", "why", ...}}}`; the exit status is the number of failures. `--dry-run` runs every
scenario on gloo CPU processes (it proves the jobs and their checks, nothing about NCCL;
about 75 s here): tests/integration/test_gpu_multi_dry_run.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness import REPO, launch, temp_root, unbroken_cmd, wait_or_kill

sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from unbroken.telemetry.events import read_events  # noqa: E402

CKPT_TRAIN = REPO / "tests" / "scripts" / "ckpt_train.py"
FSDP_TRAIN = REPO / "tests" / "scripts" / "fsdp_train.py"
STEPS = 24
TIMEOUT = 240


@dataclass(frozen=True)
class Job:
    """One `unbroken run` of a scenario: its outcome, events and final state."""

    code: int | None
    events: list[dict]
    state: dict | None
    log: str

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]


def run_job(root: Path, name: str, workers: int, script: Path, args: list[str],
            flags: list[str], device: str) -> Job:
    run_dir = root / name
    out = root / f"{name}.pt"
    state_flag = "--full-state" if script == CKPT_TRAIN else "--out"
    cmd = unbroken_cmd(workers, run_dir, script, *args, "--device", device, state_flag, str(out),
                       flags=["--on-fault", "wait", *flags])
    code = wait_or_kill(launch(cmd, run_dir), run_dir, TIMEOUT)
    events = read_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    state = torch.load(out, weights_only=True) if out.exists() else None
    log = (run_dir / "launcher.log").read_text(errors="replace")[-2000:]
    return Job(code, events, state, log)


def same(a: object, b: object) -> bool:
    """Bit for bit, through dicts and lists of tensors."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def in_place(job: Job) -> str | None:
    """Why `job` did not end in place, or None."""
    if job.code != 0:
        return f"exit {job.code}: {job.log.strip().splitlines()[-1:] if job.log else ''}"
    if job.of("restart"):
        return "fell back to a full restart"
    if not job.of("gen_up"):
        return "no generation was formed in place"
    return None


def verdict(checks: dict[str, bool], figures: dict) -> dict:
    failed = [name for name, ok in checks.items() if not ok]
    return {"result": "fail" if failed else "pass",
            "why": f"failed: {', '.join(failed)}" if failed else ", ".join(checks), **figures}


class Scenarios:
    """Each scenario's jobs and checks; the fault-free reference runs once and is shared."""

    def __init__(self, root: Path, device: str) -> None:
        self.root, self.device = root, device
        self.args = ["--steps", str(STEPS), "--step-sleep", "0.05", "--exact"]
        self._clean: Job | None = None

    def job(self, name: str, workers: int, flags: list[str], script: Path = CKPT_TRAIN,
            args: list[str] | None = None) -> Job:
        return run_job(self.root, name, workers, script, self.args if args is None else args,
                       flags, self.device)

    def clean(self) -> Job:
        if self._clean is None:
            self._clean = self.job("clean", 2, [])
        return self._clean

    def kill(self) -> dict:
        job = self.job("kill", 2, ["--fault", "crash:rank=1,step=15"])
        switches = job.of("gen_switch")
        got = [e for e in switches if e.get("received_bytes", 0) > 0]
        return verdict({"in place": in_place(job) is None,
                        "state sent to the replacement": bool(got),
                        "bit-identical": job.state is not None
                        and same(job.state, self.clean().state)},
                       {"switch_s": max((e["duration"] for e in switches), default=None),
                        "received_bytes": got[0]["received_bytes"] if got else 0,
                        "why_not": in_place(job)})

    def fence(self) -> dict:
        job = self.job("fence", 2, ["--fault", "crash:rank=1,step=12,at=update",
                                    "--fault", "slow:rank=0,step=12,at=update,seconds=60,until=abort"])
        leave = [e for e in job.of("gen_leave") if e.get("slot") == 0]
        error = leave[0].get("error", "") if leave else ""
        return verdict({"in place": in_place(job) is None,
                        "refused at the fence": error.startswith("UpdateRefused"),
                        "bit-identical": job.state is not None
                        and same(job.state, self.clean().state)},
                       {"leave_error": error, "why_not": in_place(job)})

    def never_arrives(self) -> dict:
        job = self.job("never_arrives", 3, ["--fault", "crash:rank=1,step=10",
                                            "--fault", "crash:rank=2,step=0,at=join"])
        failed = job.of("switch_failed")
        return verdict({"in place": in_place(job) is None,
                        "a generation failed to form, bounded": bool(failed)},
                       {"switch_failed": len(failed), "why_not": in_place(job)})

    def spare(self) -> dict:
        args = ["--steps", "200", "--step-sleep", "0.05"]  # 10 s: the spare warms up first
        job = self.job("spare", 2, ["--spares", "1", "--fault", "crash:rank=1,step=150"],
                       args=args)
        promoted = [e for e in job.of("spare_promoted") if e.get("source") == "worker"]
        return verdict({"in place": in_place(job) is None,
                        "the spare took slot 1": [e["slot"] for e in promoted] == [1]},
                       {"why_not": in_place(job)})

    def hsdp(self) -> dict:
        args = ["--hsdp", "--steps", str(STEPS), "--step-sleep", "0.05", "--snapshot-every", "5"]
        job = self.job("hsdp", 4, ["--fault", "crash:rank=1,step=12"], FSDP_TRAIN, args)
        syncs = job.of("shard_sync")
        return verdict({"in place": in_place(job) is None,
                        "no step lost": bool(syncs) and {e["step"] for e in syncs} == {12}},
                       {"why_not": in_place(job)})


NEEDS: dict[str, int] = {"kill": 2, "fence": 2, "never_arrives": 3, "spare": 3, "hsdp": 4}
"""Each scenario and the GPUs it needs (one per worker and spare)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"scenarios, from {', '.join(NEEDS)}")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same jobs on gloo CPU processes: nothing about NCCL")
    args = parser.parse_args()
    chosen = [n.strip() for n in args.only.split(",") if n.strip()] or list(NEEDS)
    if unknown := [n for n in chosen if n not in NEEDS]:
        parser.error(f"--only: no scenario {unknown}; the scenarios are {', '.join(NEEDS)}")
    gpus = 0 if args.dry_run else torch.cuda.device_count()
    if not args.dry_run and gpus < 2:
        print(f"{gpus} GPU(s): every scenario needs 2 or more (--dry-run runs them on CPU)",
              file=sys.stderr)
        return 2
    scenarios = Scenarios(temp_root("unbroken-gpu-multi-"), "cpu" if args.dry_run else "cuda")
    results = {}
    for name in chosen:
        t0 = time.monotonic()
        if not args.dry_run and gpus < NEEDS[name]:
            results[name] = {"result": "skipped", "why": f"needs {NEEDS[name]} GPUs, {gpus} here"}
        else:
            fn: Callable[[], dict] = getattr(scenarios, name)
            try:
                results[name] = fn()
            except Exception as exc:  # noqa: BLE001 - a scenario that raised is a failed one
                results[name] = {"result": "fail", "why": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"{name:14} {results[name]['result']:7} {results[name]['seconds']:6.1f}s  "
              f"{results[name]['why']}", flush=True)
    print(json.dumps({"torch": torch.__version__, "gpus": gpus, "dry_run": args.dry_run,
                      "scenarios": results}, default=str))
    return sum(1 for r in results.values() if r["result"] == "fail")


if __name__ == "__main__":
    sys.exit(main())
