"""Entry point of every worker process: `python -m unbroken.runtime.bootstrap SCRIPT ARGS`.

It ties the worker's life to its agent's (so killing an agent leaves no worker behind),
runs the user's script exactly as `python SCRIPT ARGS` would, and records an uncaught
exception's traceback where the agent reads it.

With `--warm` (`WARM_FLAG`) it is a warm interpreter for a restart (`launch/workers/warm_pool.py`):
it imports torch (the bulk of a worker's start-up) ahead of time, then, while it waits on
stdin for its assignment (environment, arguments, log file), imports what the node's workers
imported in the previous attempt (`warm_imports`: installed packages only), and becomes that
worker. Its events (`standby_ready`, `standby_imports`, `standby_taken`, source `standby`)
keep the names they had before the term.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import select
import signal
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from unbroken.control.worker_env import WARM_FLAG, Role, WorkerEnv
from unbroken.errors import classify
from unbroken.exiting import exit_without_teardown
from unbroken.runtime.groups import script_group
from unbroken.runtime.warm_imports import ImportRecorder, Preimporter, modules_path
from unbroken.telemetry import schema as ev

if TYPE_CHECKING:
    from unbroken.telemetry.events import EventLog

_PR_SET_PDEATHSIG = 1
_LIST_POLL = 1.0  # seconds between a warm interpreter's looks at the node's module list, once caught up


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


def _user_frames(tb):  # noqa: ANN001, ANN202 - a traceback object
    """The traceback from the script's first frame on, as `python script.py` would show it:
    the bootstrap's and runpy's frames above the script are ours, not the user's."""
    first = tb
    ours = {__file__, os.path.join(os.path.dirname(os.path.dirname(__file__)), "worker.py")}
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in ours and "runpy" not in name:
            return tb
        tb = tb.tb_next
    return first


def _write_error(exc: BaseException) -> None:
    path = WorkerEnv.from_environ().error_file
    if not path:
        return
    record = {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(
            type(exc), exc, _user_frames(exc.__traceback__))),
        "pid": os.getpid(),
        "error_class": classify(exc).value,  # whose fault: the agent blames by it
        # The code the interpreter is about to exit with: the agent reports it before the
        # (sometimes second-long) teardown is over.
        "exit_code": (exc.code if isinstance(exc.code, int) else 1)
        if isinstance(exc, SystemExit) else 1,
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    os.replace(tmp, path)


def _lower_priority() -> Callable[[], None]:
    """Warm up only on CPU time training leaves idle (SCHED_IDLE), so a warm interpreter's
    imports never slow the live job; returns how to get normal priority back. Only where we may
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
    import torch  # noqa: F401  - the point of a warm interpreter: pay for these imports early
    import torch._dynamo  # noqa: F401  - imported by the first optimizer built: ~1 s
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import unbroken.runtime.run  # noqa: F401
    from unbroken.telemetry.events import EVENTS_FILE, EventLog

    env = WorkerEnv.from_environ()
    log = EventLog(os.path.join(env.run_dir, EVENTS_FILE) if env.run_dir else None,
                   source="standby", node=env.node_rank)  # the name predates the term
    log.emit(ev.WarmInterpreterReady(pid=os.getpid(), warmup=round(time.monotonic() - t0, 6)))
    pre = Preimporter(modules_path(env.run_dir, env.node_rank)) if env.run_dir else None
    try:
        line = _preimport_until_assigned(pre, log)
        if not line:
            return None  # the agent closed the pool
        assignment = json.loads(line)
        if pre is not None:
            taken = WorkerEnv.from_environ(assignment["env"])
            log.emit(ev.WarmInterpreterTaken(pid=os.getpid(), rank=taken.rank,
                     attempt=taken.attempt, modules=pre.added, pending=pre.missing(),
                     failed=pre.failed, refused=pre.refused))
    finally:
        log.close()
    restore()
    os.environ.clear()
    os.environ.update(assignment["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout.flush()  # what a pre-import printed belongs to the console, not the rank's log
    sys.stderr.flush()
    for stream, target in ((1, assignment.get("stdout")), (2, assignment.get("stderr"))):
        if target:  # else the agent's console, which it already writes to
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, stream)
            os.close(fd)
    return assignment["argv"]


def _preimport_until_assigned(pre: Preimporter | None, log: EventLog) -> str:
    """Read the assignment line from stdin; meanwhile import the node's listed modules, one
    at a time between non-blocking looks at stdin, so that an assignment waits at most for
    the one import under way (a module the script imports anyway, mostly). No thread: a
    background import racing the script's own imports could deadlock on import locks."""
    reported = 0
    if pre is not None:
        pre.refresh()
    while True:
        busy = pre is not None and pre.pending > 0
        ready, _, _ = select.select([sys.stdin], [], [], 0 if busy else _LIST_POLL)
        if ready:
            return sys.stdin.readline()
        if pre is None:
            continue
        if not busy:
            pre.refresh()
            continue
        pre.step()
        if pre.pending == 0 and pre.added != reported:  # caught up with the list
            reported = pre.added
            log.emit(ev.WarmInterpreterImports(pid=os.getpid(), modules=pre.added,
                     failed=pre.failed, refused=pre.refused, duration=round(pre.seconds, 6)))


def _record_imports(script: str | None) -> None:
    """A worker keeps its installed modules listed for the next attempt's warm interpreters
    (`warm_imports`: one worker of the node at a time writes the list)."""
    env = WorkerEnv.from_environ()
    if env.run_dir and env.role == Role.WORKER and env.record_imports:
        script_dir = os.path.dirname(os.path.abspath(script)) if script else None
        ImportRecorder(modules_path(env.run_dir, env.node_rank), script_dir).start()


def main() -> None:
    _die_with_agent()
    args = sys.argv[1:]
    if args[:1] == [WARM_FLAG]:
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
    _record_imports(None if as_module else target)
    script_group.install(WorkerEnv.from_environ())  # the script's own group is the launcher's
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
