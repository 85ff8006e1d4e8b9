"""Entry point of every worker process: `python -m unbroken.runtime.bootstrap SCRIPT ARGS`.

It ties the worker's life to its agent's (so killing an agent leaves no worker behind),
runs the user's script exactly as `python SCRIPT ARGS` would, and records an uncaught
exception's traceback where the agent reads it.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import traceback

_PR_SET_PDEATHSIG = 1


def _die_with_agent() -> None:
    """Ask the kernel to SIGKILL us when the agent dies, then close the fork/prctl race."""
    agent_pid = os.environ.get("UNBROKEN_AGENT_PID")
    if not agent_pid or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(agent_pid):
        os._exit(1)  # the agent died before prctl took effect


def _write_error(exc: BaseException) -> None:
    path = os.environ.get("UNBROKEN_ERROR_FILE")
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


def main() -> None:
    _die_with_agent()
    args = sys.argv[1:]
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


if __name__ == "__main__":
    main()
