"""Warm standbys for restarts: interpreters that have already imported torch, and what the
workers imported.

Most of a restarted worker's start-up is `import torch` (3-4 s of a 5 s restart with 4
workers on 2 cores), and a plain script adds its own libraries' imports (transformers: 2-3 s
more here). The pool starts one standby per local worker once training is running, so the
imports overlap with training instead of stalling the restart; a standby imports torch,
then, while it waits, the modules the node's workers have imported (`runtime/warm_imports`:
installed packages and the standard library only, never the script's own modules); a
restart hands each standby its rank's environment and arguments over a pipe.

Caveat, documented: a script that changes variables read at import time by torch or by a
library it imports (for example OMP_NUM_THREADS) before importing them gets them only on
the first attempt, and a library that reads the rank variables (RANK, LOCAL_RANK, ...) at
import time reads none in a standby; `--no-warm-restarts` turns the pool off.
"""

from __future__ import annotations

import json
import os
import subprocess

from unbroken.launch.orphan_guard import OrphanGuard
from unbroken.launch.worker_logs import WorkerStreams
from unbroken.launch.worker_process import BOOTSTRAP


def normal_priority(pid: int) -> None:
    """A standby or spare under SCHED_IDLE would starve behind training once it is needed:
    give it, every thread of it, normal priority now (a standby still importing restores
    its own once its imports are done)."""
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
    def __init__(self, size: int, env: dict[str, str], guard: OrphanGuard) -> None:
        self.size = size
        self.env = env
        self.guard = guard
        self._standbys: list[subprocess.Popen] = []

    def _drop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self.guard.forget(proc.pid)

    def fill(self) -> int:
        """Start standbys up to the pool's size; returns how many were started."""
        for dead in [p for p in self._standbys if p.poll() is not None]:
            self._drop(dead)
            self._standbys.remove(dead)
        started = 0
        while len(self._standbys) < self.size:
            proc = subprocess.Popen(
                [*BOOTSTRAP, "--standby"],
                stdin=subprocess.PIPE, env=self.env, start_new_session=True,
            )
            self.guard.watch(proc.pid)
            self._standbys.append(proc)
            started += 1
        return started

    @property
    def full(self) -> bool:
        return len(self._standbys) >= self.size

    def take(self, env: dict[str, str], argv: list[str],
             streams: WorkerStreams | None) -> subprocess.Popen | None:
        """A live standby turned into the worker described, or None if the pool is empty."""
        while self._standbys:
            proc = self._standbys.pop(0)
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
        """Stop every standby at once: they hold no state worth a graceful exit."""
        for proc in self._standbys:
            self._drop(proc)
        self._standbys = []
