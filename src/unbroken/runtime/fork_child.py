"""The fork server's child: a forked worker makes itself what a fresh interpreter would be.

`become` runs in the worker the server just forked (`fork_server._fork`), before the
worker's entry point: its own session; its agent as its parent (the intermediate has
exited); the request's environment, working directory and output files; what the server
was started with (`Birth`: signal dispositions, umask, scheduling policy, nice value), the
signal mask emptied; none of the server's own open files (its event log); its RNGs seeded
anew and torch's thread count from its own `OMP_NUM_THREADS`; the garbage collector back on
every object; and, seen from outside, `python SCRIPT ARGS` as its command line and its
rank's variables as its environment (written over areas the agent padded, as setproctitle
does). Then it runs the entry point and exits with the status `python` would.
"""

from __future__ import annotations

import ctypes
import gc
import os
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.control.fork_requests import PAD_VARIABLE, ForkRequest
from unbroken.telemetry.events import EventLog

_REPARENT_WAIT = 5.0  # seconds a child waits to become its agent's (the intermediate exits at once)
_STAT_ARG_START = 47 - 2  # /proc/self/stat field 48 (arg_start), counted after the ")"
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


@dataclass(frozen=True)
class Birth:
    """What the server was started with, as any fresh interpreter its agent starts is: each
    child gets it back, whatever the server changed since (a preimport's signal handler,
    the idle policy it imports under, a umask)."""

    signals: dict[int, Any]
    """Each signal's disposition (`signal.getsignal`), but those set outside Python."""
    umask: int
    policy: int
    priority: int
    nice: int

    @classmethod
    def now(cls) -> Birth:
        """Taken first thing in the server, before any import of its own."""
        umask = os.umask(0o077)
        os.umask(umask)
        dispositions = {}
        for s in signal.valid_signals():
            if s not in _UNCATCHABLE:
                handler = signal.getsignal(s)
                if handler is not None:
                    dispositions[int(s)] = handler
        return cls(dispositions, umask, os.sched_getscheduler(0),
                   os.sched_getparam(0).sched_priority, os.getpriority(os.PRIO_PROCESS, 0))

    def restore(self) -> None:
        for s, handler in self.signals.items():
            if signal.getsignal(s) is not handler:
                signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.umask(self.umask)
        try:
            if os.sched_getscheduler(0) != self.policy:
                os.sched_setscheduler(0, self.policy, os.sched_param(self.priority))
            if os.getpriority(os.PRIO_PROCESS, 0) != self.nice:
                os.setpriority(os.PRIO_PROCESS, 0, self.nice)
        except OSError:
            pass  # raising a priority back needs root: the server only ever lowers its own


def become(request: ForkRequest, conn: socket.socket, child_main: Callable[[], None],
           birth: Birth, server_log: EventLog) -> None:
    """In the worker: make the process what a fresh interpreter would be, run the worker's
    entry point, and exit with the status `python` would have. Never returns."""
    code = 1
    try:
        os.close(conn.detach())  # the agent's connection is the server's alone
        server_log.abandon()  # the server's event log: written by the server alone
        os.setsid()  # its own session and process group, as `start_new_session` gives
        agent = int(request.env.get("UNBROKEN_AGENT_PID") or 0)
        _await_parent(agent)
        birth.restore()
        os.environ.clear()
        os.environ.update(request.env)
        if request.cwd:
            os.chdir(request.cwd)
        _streams(request.stdout, request.stderr)
        _fresh_state()
        set_title(b"\0".join(a.encode() for a in [os.path.basename(sys.executable),
                                                  *request.argv]))
        _set_environ(request.env)
        sys.argv = ["-m unbroken.worker", *request.argv]
        child_main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _await_parent(agent: int) -> None:
    """Until the intermediate has exited and the agent (the subreaper) is our parent."""
    deadline = time.monotonic() + _REPARENT_WAIT
    while agent and os.getppid() != agent and time.monotonic() < deadline:
        time.sleep(0.001)


def _streams(stdout: str | None, stderr: str | None) -> None:
    """stdin from /dev/null; stdout and stderr to the worker's files (else the agent's
    console, which the server's already are)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, target in ((1, stdout), (2, stderr)):
        if target:
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)


def _fresh_state() -> None:
    """What a fresh interpreter would have, and the server's state does not: the RNGs
    seeded anew, torch's thread count from this worker's `OMP_NUM_THREADS`, the collector
    back on every object."""
    import torch

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    torch.seed()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    os.environ.pop(PAD_VARIABLE, None)
    gc.unfreeze()


def _stat_field(index: int) -> int:
    with open("/proc/self/stat", encoding="ascii") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[index])


def _overwrite(start: int, end: int, data: bytes) -> None:
    """Write `data` (cut to fit, NUL-ended) over our own memory [start, end)."""
    size = end - start
    if size <= 1:
        return
    body = data[:size - 1]
    ctypes.memmove(start, body + b"\0" * (size - len(body)), size)


def set_title(title: bytes) -> None:
    """What `ps` and `/proc/PID/cmdline` show: the arguments area the server was started
    with (padded by the agent), as setproctitle does."""
    try:
        start, end = _stat_field(_STAT_ARG_START), _stat_field(_STAT_ARG_START + 1)
    except (OSError, ValueError, IndexError):
        return
    _overwrite(start, end, title)


def _set_environ(env: dict[str, str]) -> None:
    """What `/proc/PID/environ` shows: this worker's variables, written over the server's
    environment block (padded by the agent: `PAD_VARIABLE`); cut where it does not fit."""
    try:
        start, end = _stat_field(_STAT_ARG_START + 2), _stat_field(_STAT_ARG_START + 3)
    except (OSError, ValueError, IndexError):
        return
    _overwrite(start, end, b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
