"""Entry point of every worker process: `python -m unbroken.runtime.bootstrap SCRIPT ARGS`.

It ties the worker's life to its agent's (so killing an agent leaves no worker behind),
runs the user's script exactly as `python SCRIPT ARGS` would, and records an uncaught
exception's traceback where the agent reads it.

With `--standby` it is a warm standby for a restart: it imports torch (the bulk of a
worker's start-up) ahead of time, then waits on stdin for its assignment (environment,
arguments, log file) and becomes that worker.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Callable

from unbroken.control.worker_env import WorkerEnv
from unbroken.exiting import exit_without_teardown
from unbroken.telemetry.event_names import Event

_PR_SET_PDEATHSIG = 1


def _die_with_agent() -> None:
    """Ask the kernel to SIGKILL us when the agent dies, then close the fork/prctl race."""
    agent_pid = WorkerEnv.from_environ().agent_pid
    if not agent_pid or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(agent_pid):
        os._exit(1)  # the agent died before prctl took effect


def _write_error(exc: BaseException) -> None:
    path = WorkerEnv.from_environ().error_file
    if not path:
        return
    record = {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "pid": os.getpid(),
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)


def _lower_priority() -> Callable[[], None]:
    """Warm up only on CPU time training leaves idle (SCHED_IDLE), so a standby's imports
    never slow the live job; returns how to get normal priority back. Only where we may
    restore it afterwards: raising priority again needs root or CAP_SYS_NICE."""
    if os.geteuid() != 0:
        return lambda: None
    try:
        policy = os.sched_getscheduler(0)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return lambda: os.sched_setscheduler(0, policy, os.sched_param(0))
    except (AttributeError, OSError):
        priority = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(19, priority + 10))
        return lambda: os.setpriority(os.PRIO_PROCESS, 0, priority)


def _await_assignment() -> list[str] | None:
    """Warm up, then block until the agent assigns a rank; None if it never does."""
    import time

    t0 = time.monotonic()
    restore = _lower_priority()
    import torch  # noqa: F401  - the point of a standby: pay for these imports in advance
    import torch._dynamo  # noqa: F401  - imported by the first optimizer built: ~1 s
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import unbroken.runtime.session  # noqa: F401
    from unbroken.telemetry.events import EVENTS_FILE, EventLog

    env = WorkerEnv.from_environ()
    log = EventLog(os.path.join(env.run_dir, EVENTS_FILE) if env.run_dir else None,
                   source="standby", node=env.node_rank)
    log.emit(Event.STANDBY_READY, pid=os.getpid(), warmup=round(time.monotonic() - t0, 6))
    log.close()
    line = sys.stdin.readline()
    if not line:
        return None  # the agent closed the pool
    assignment = json.loads(line)
    restore()
    os.environ.clear()
    os.environ.update(assignment["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if assignment.get("log"):
        fd = os.open(assignment["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return assignment["argv"]


def main() -> None:
    _die_with_agent()
    args = sys.argv[1:]
    if args[:1] == ["--standby"]:
        assigned = _await_assignment()
        if assigned is None:
            return
        args = assigned
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        sys.exit("usage: python -m unbroken.runtime.bootstrap [-m] SCRIPT [ARGS]")
    target = args[0]
    sys.argv = args
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            _write_error(exc)
            raise
    except BaseException as exc:
        _write_error(exc)
        raise
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
