"""Entry point of every worker process: `python -m unbroken.runtime.bootstrap SCRIPT ARGS`.

It ties the worker's life to its agent's (so killing an agent leaves no worker behind),
runs the user's script exactly as `python SCRIPT ARGS` would, and records an uncaught
exception's traceback where the agent reads it.

A worker forked by the node's fork server (`runtime/fork_server.py`) runs the same `main`,
its environment and arguments already its own.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

from unbroken.control.worker_env import Role, WorkerEnv
from unbroken.errors import classify
from unbroken.exiting import exit_without_teardown
from unbroken.kinship import die_with
from unbroken.runtime.groups import script_group
from unbroken.runtime.warm_imports import ImportRecorder, modules_path
from unbroken.runtime.watch import hooks, watcher


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








def _record_imports(script: str | None) -> None:
    """A worker keeps its installed modules listed for the node's fork server to import
    (`warm_imports`: one worker of the node at a time writes the list)."""
    env = WorkerEnv.from_environ()
    if env.run_dir and env.role == Role.WORKER and env.record_imports:
        script_dir = os.path.dirname(os.path.abspath(script)) if script else None
        ImportRecorder(modules_path(env.run_dir, env.node_rank), script_dir).start()


def main() -> None:
    die_with(int(WorkerEnv.from_environ().agent_pid or 0))
    args = sys.argv[1:]
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        sys.exit("usage: python -m unbroken.runtime.bootstrap [-m] SCRIPT [ARGS]")
    target = args[0]
    sys.argv = args
    _record_imports(None if as_module else target)
    script_group.install(WorkerEnv.from_environ())  # the script's own group is the launcher's
    watcher.start(hooks.installed, hooks.failed)
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        watcher.finish()
        if exc.code not in (None, 0):
            _write_error(exc)
            raise
    except BaseException as exc:
        watcher.finish()
        _write_error(exc)
        raise
    watcher.finish()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
