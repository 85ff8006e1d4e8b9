"""Warm interpreters for restarts: interpreters that have already imported torch, and what
the workers imported.

Most of a restarted worker's start-up is `import torch` (3-4 s of a 5 s restart with 4
workers on 2 cores), and a plain script adds its own libraries' imports (transformers: 2-3 s
more here). The pool starts one warm interpreter per local worker once training is running,
so the imports overlap with training instead of stalling the restart; a warm interpreter
imports torch, then, while it waits, the modules the node's workers have imported
(`runtime/warm_imports`: installed packages and the standard library only, never the
script's own modules); a restart hands each its rank's environment and arguments over a
pipe. (Not the standby nodes of `--standby`, whose every process is a spare. The events
`standbys_started`, `standby_ready`, `standby_imports` and `standby_taken` are about warm
interpreters: their names predate the term.)

Caveat, documented: a script that changes variables read at import time by torch or by a
library it imports (for example OMP_NUM_THREADS) before importing them gets them only on
the first attempt, and a library that reads the rank variables (RANK, LOCAL_RANK, ...) at
import time reads none in a warm interpreter; `--no-warm-restarts` turns the pool off.
"""

from __future__ import annotations

import json
import os
import subprocess

from unbroken.control.worker_env import WARM_FLAG
from unbroken.launch.workers.orphan_guard import OrphanGuard
from unbroken.launch.workers.worker_logs import WorkerStreams
from unbroken.launch.workers.worker_process import BOOTSTRAP


def normal_priority(pid: int) -> None:
    """A warm interpreter or spare under SCHED_IDLE would starve behind training once it is
    needed: give it, every thread of it, normal priority now (a warm interpreter still
    importing restores its own once its imports are done)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except (AttributeError, OSError):
            pass  # not ours to change (not root) or already gone: it runs at its own pace


class WarmPool:
    """This node's warm interpreters: `fill` starts them, `take` hands one a worker's rank."""

    def __init__(self, size: int, env: dict[str, str], guard: OrphanGuard) -> None:
        self.size = size
        self.env = env
        self.guard = guard
        self._interpreters: list[subprocess.Popen] = []

    def _drop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self.guard.forget(proc.pid)

    def fill(self) -> int:
        """Start warm interpreters up to the pool's size; returns how many were started."""
        for dead in [p for p in self._interpreters if p.poll() is not None]:
            self._drop(dead)
            self._interpreters.remove(dead)
        started = 0
        while len(self._interpreters) < self.size:
            proc = subprocess.Popen(
                [*BOOTSTRAP, WARM_FLAG],
                stdin=subprocess.PIPE, env=self.env, start_new_session=True,
            )
            self.guard.watch(proc.pid)
            self._interpreters.append(proc)
            started += 1
        return started

    @property
    def full(self) -> bool:
        return len(self._interpreters) >= self.size

    def take(self, env: dict[str, str], argv: list[str],
             streams: WorkerStreams | None) -> subprocess.Popen | None:
        """A live warm interpreter turned into the worker described, or None if the pool is empty."""
        while self._interpreters:
            proc = self._interpreters.pop(0)
            if proc.poll() is not None:
                self._drop(proc)
                continue
            line = json.dumps({"env": env, "argv": argv,
                               "stdout": streams.stdout if streams else None,
                               "stderr": streams.stderr if streams else None})
            try:
                proc.stdin.write(line.encode() + b"\n")
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                self._drop(proc)
                continue
            normal_priority(proc.pid)
            return proc
        return None

    def close(self) -> None:
        """Stop every warm interpreter at once: they hold no state worth a graceful exit."""
        for proc in self._interpreters:
            self._drop(proc)
        self._interpreters = []
