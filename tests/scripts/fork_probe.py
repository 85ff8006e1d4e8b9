"""A worker that says how it was started, then waits to be looked at from outside.

Writes OUT/rank<R>.json (its pid, parent, session, torch's thread count, sys.argv, whether
torch was imported before the script ran, and `fresh`: what a fresh interpreter must have,
whoever started it: signal dispositions and mask, open fds, umask, scheduling policy and
nice value, `__main__`'s name), then waits for OUT/go and exits with the code
OUT/exit<R> holds (0 if none). Plain torchrun style: no unbroken API, no process group.
"""

import sys

_torch_before = "torch" in sys.modules

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def _disposition(s: signal.Signals) -> str:
    h = signal.getsignal(s)
    return {signal.SIG_DFL: "default", signal.SIG_IGN: "ignore",
            signal.default_int_handler: "KeyboardInterrupt"}.get(h, "a handler")


def _fds() -> list[str]:
    found = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd, closed by now
        if target == os.path.join(os.environ.get("UNBROKEN_RUN_DIR", "-"), "events.jsonl"):
            target = "the run's event log"  # the worker's own: it says what its script does
        found.append(f"{fd}: {target if int(fd) > 2 else 'std'}")
    return found


umask = os.umask(0o022)
os.umask(umask)
fresh = {"signals": {s.name: _disposition(s) for s in signal.valid_signals()
                     if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)},
         "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
         "fds": _fds(), "umask": umask, "policy": os.sched_getscheduler(0),
         "nice": os.getpriority(os.PRIO_PROCESS, 0), "main": __name__}
out = sys.argv[1]
rank = int(os.environ["RANK"])
with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as fh:
    json.dump({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
               "threads": torch.get_num_threads(), "argv": sys.argv,
               "torch_before": _torch_before, "fresh": fresh}, fh)
os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    time.sleep(0.02)
code = os.path.join(out, f"exit{rank}")
sys.exit(int(open(code).read()) if os.path.exists(code) else 0)
