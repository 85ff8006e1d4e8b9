"""What one GPU can check of the NCCL and CUDA paths (shared/reviews/nccl-risks.md), ready
for the day a GPU is lent (the `device` tool):

    PYTHONPATH=src python3 benchmarks/gpu_check.py                 # every check, < 5 min
    PYTHONPATH=src python3 benchmarks/gpu_check.py --only A,C      # a subset again
    PYTHONPATH=src python3 benchmarks/gpu_check.py --dry-run       # on CPU, gloo: the code only

The checks (`gpu_checks.py`; the letters are the review's, I and the numbers ours):

- A abort with work queued: the all-reduce aborted while queued behind ~1 s of GPU work;
  how long the abort takes, whether a stream sync then raises (risk 1's premise: it does
  not), what `get_error()` says, that the fence refuses the update, that the next
  collective is a peer error.
- B a stale `exception_dump` key in the job's store, torch's heartbeat monitor at 5 s, our
  in-place environment: the process survives 30 s (risk 3).
- C generation churn: 10 generations formed, a DDP step twice, aborted, torn down; threads,
  fds, RSS and device memory must stay flat (risk 10).
- D backend strings: `init_process_group()`, `"cpu:gloo,cuda:nccl"` and `"nccl"`: the group
  holds NCCL, `interrupt` reaches it, the next collective fails as a peer error (risk 4).
- E pinned footprint: the checkpoint staging's pinned host bytes against the tensors', for
  odd sizes: one registered buffer of exact size, nothing in torch's caching host allocator
  (risk 7).
- F state sync through the device: torch refuses point-to-point to self, so one GPU cannot
  carry it: skipped, saying so (`gpu_multi.py` needs 2 GPUs).
- G FSDP2 aborted mid-forward: reset, re-formed, mesh rebound, a step; device memory back
  to the level before the failed step (risk 10).
- H environment facts: the backend's class, NCCL's version, the settings torch reports.
- I the fence's cost: a bf16 GPT-size model with fused AdamW, 50 steps with and without the
  fence, medians.
- J a planned switch's leave with an all-reduce queued: the device drains before the abort,
  and the all-reduce's result is whole.
- K two NCCL groups (the default and another, as HSDP has) with work queued, aborted
  together, each in a thread of its own, within `ABORT_BOUND` (risk 6).
- L a worker forked from the node's fork server, after it pre-imported torch and the real
  preimport list (transformers, accelerate: those installed), initialises CUDA, forms an
  NCCL world of one and steps (`gpu_fork_probe.py` under `unbroken run`).
- M the snapshot exchange's ring: a 256 MiB device shard streamed through 4 pinned 4 MiB
  chunks on their own stream; host memory during it within the ring's 16 MiB, the bytes
  equal (risk 8; a whole round needs a buddy on another rank: `gpu_multi.py`).
- 1 checkpoints of CUDA tensors equal clones taken at each commit; 4 a device-side assert is
  the worker's own device error; 6 the replica checksum on the device equals the CPU's.

Each check runs in a process of its own (`--child`), with its own timeout and the
environment `unbroken run` gives an in-place worker (the launcher's `launcher_defaults`),
and appends its JSON line to `--out` when it ends, so a run cut off still returns what ran
(a timeout or a crash is `fail`). The last line printed is one JSON object:
`{"torch", "device", "dry_run", "checks": {"A_abort_queued": {"result": "pass"|"fail"|
"skipped", "why", ...figures}}}`; the exit status is the number of failures.

`--dry-run` runs each check's own code on CPU tensors and gloo up to its first CUDA-only
call (A, C, D, E, F, G, J, K, L, M, 1 and 6 run their control flow; B, H, I and 4 are skipped)
and says what it exercised: it proves the script, nothing about CUDA. It runs in the integration tier
(tests/integration/test_gpu_check_dry_run.py). The script needs torch >= 2.11 and nothing of
the venv: the lent machines have their own torch and no network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import gpu_checks  # noqa: E402


def in_place_env() -> dict[str, str]:
    """The environment an in-place worker gets from `unbroken run` (its NCCL settings)."""
    from unbroken.launch.config import LaunchConfig
    from unbroken.launch.workers.worker_spawn import launcher_defaults

    env = launcher_defaults(dict(os.environ), LaunchConfig(script="train.py"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent / "src"),
                                                      os.environ.get("PYTHONPATH")]))
    return env


def run_check(key: str, out: Path, dry: bool, env: dict[str, str]) -> dict:
    """`key`'s check in a child process; its line from `out`, or a `fail` saying why not."""
    timeout = gpu_checks.CHECKS[key].timeout
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", key, "--out", str(out)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd + (["--dry-run"] if dry else []), env=env, timeout=timeout,
                              capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        crashed = proc.returncode != 0
    except subprocess.TimeoutExpired as exc:
        tail = (((exc.stdout or b"") + (exc.stderr or b"")).decode(errors="replace")
                .strip().splitlines()[-6:])
        crashed, proc = True, None
    seconds = round(time.monotonic() - t0, 1)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    found = next((line for line in lines if line.get("check") == key), None)
    if found is not None:
        found["seconds"] = seconds
        return found
    why = (f"timed out after {timeout} s" if proc is None
           else f"exited {proc.returncode}" if crashed else "wrote no result")
    line = {"check": key, "result": "fail", "why": f"{why}: {' | '.join(tail)}",
            "seconds": seconds}
    stacks = gpu_checks.stacks_file(out, key)
    if stacks.exists() and stacks.stat().st_size:  # it hung: where, thread by thread
        line["stacks"] = stacks.read_text(errors="replace")[-6000:]
    with out.open("a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="check letters or numbers, e.g. A,C,1")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU tensors and gloo: the checks' own code, nothing about CUDA")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON lines file (default: a new one in the temp folder)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="checks run at once (with --dry-run only: on a GPU the checks "
                             "share one device, and their timings must not)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return gpu_checks.run_child(args.child, args.out, args.dry_run)
    keys = list(gpu_checks.CHECKS)
    if args.only:
        wanted = {w.strip().upper() for w in args.only.split(",") if w.strip()}
        unknown = wanted - {k.split("_")[0].upper() for k in keys}
        if unknown:
            parser.error(f"--only: no check {sorted(unknown)}; the checks are "
                         f"{', '.join(k.split('_')[0] for k in keys)}")
        keys = [k for k in keys if k.split("_")[0].upper() in wanted]
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to exercise the checks on CPU", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="unbroken-gpu-check-")) / "checks.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = in_place_env()
    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0)
    print(f"{device}, torch {torch.__version__}; results in {out}", flush=True)
    if args.jobs > 1 and not args.dry_run:
        parser.error("--jobs: with --dry-run only (the checks share one GPU)")
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        lines = list(pool.map(lambda key: run_check(key, out, args.dry_run, env), keys))
    checks = {}
    for key, line in zip(keys, lines, strict=True):
        checks[key] = {k: v for k, v in line.items() if k != "check"}
        print(f"{key:18} {line['result']:7} {line.get('seconds', 0):6.1f}s  {line['why']}",
              flush=True)
    print(json.dumps({"torch": torch.__version__, "device": device, "dry_run": args.dry_run,
                      "checks": checks}))
    return sum(1 for c in checks.values() if c["result"] == "fail")


if __name__ == "__main__":
    sys.exit(main())
