"""`unbroken demo`: the example GPT on 4 workers, through a SIGKILL, a hang and an exception.

It runs the real launcher in this process (real worker processes, real signals), prints
progress from the event log as it goes, and ends with the run's summary.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from unbroken.errors import UserError
from unbroken.launch.agent import Agent
from unbroken.launch.config import LaunchConfig
from unbroken.launch.flags.groups import Recovery
from unbroken.launch.log_spec import LogSpec, Std
from unbroken.telemetry.events import EVENTS_FILE
from unbroken.telemetry.live import EventTail
from unbroken.telemetry.report import build_report, format_goodput
from unbroken.telemetry.summary import format_summary, summarize


def find_example() -> Path:
    here = Path(__file__).resolve()
    for root in (Path.cwd(), *here.parents):
        script = root / "examples" / "gpt" / "train.py"
        if script.is_file():
            return script
    raise UserError("cannot find examples/gpt/train.py; run `unbroken demo` from the repository root")


def _follow(events: Path, total: int, stop: threading.Event) -> None:
    """Print rank 0's progress and every fault as the event log grows."""
    tail = EventTail(events)
    try:
        while not stop.wait(0.1):
            for e in tail.read():
                if e["event"] == "step" and e.get("rank") == 0 and e["step"] % 10 == 0:
                    print(f"  step {e['step']:4d}/{total}  loss {e.get('loss', float('nan')):.3f}"
                          f"  ({1000 * e['duration']:.0f} ms)", flush=True)
                elif e["event"] == "fault_injected":
                    print(f"  >>> injecting {e['fault']}", flush=True)
                elif e["event"] == "checkpoint_loaded" and e.get("rank") == 0:
                    print(f"  resumed from the checkpoint of step {e['step']}", flush=True)
    finally:
        tail.close()


def run_demo(steps: int = 600, workers: int = 4, run_dir: str | None = None, faults: bool = True) -> int:
    script = find_example()
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(run_dir or Path("unbroken_runs") / run_id)
    plan = []
    if faults:
        # Off the checkpoint interval (10), so each fault also costs some redone steps.
        plan = [f"crash:rank={1 % workers},step={steps // 4 + 3}",
                f"hang:rank={2 % workers},step={steps // 2 + 6}",
                f"exception:rank={3 % workers},step={3 * steps // 4 + 4}"]
    cfg = LaunchConfig(
        script=str(script),
        script_args=["--steps", str(steps), "--checkpoint-dir", str(out / "checkpoints"),
                     "--checkpoint-every", "10", "--print-every", str(10 ** 9)],
        nproc_per_node=workers, master_port=0, recovery=Recovery(max_restarts=len(plan) + 2),
        run_id=run_id, run_dir=out, logs=LogSpec(redirects=Std.ALL), faults=";".join(plan),
    )
    print(f"unbroken demo: {workers} workers train a small GPT for {steps} steps (DDP over gloo);")
    print(f"faults to inject: {', '.join(plan) or 'none'}")
    print(f"worker logs and events: {out}\n", flush=True)
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(out / EVENTS_FILE, steps, stop), daemon=True)
    follower.start()
    code = Agent(cfg, out=sys.stdout).run()
    time.sleep(0.3)
    stop.set()
    follower.join(timeout=2)
    print()
    print(format_summary(summarize(out)))
    print(format_goodput(build_report([out])))
    return code
