"""A watchdog process that kills the workers' process groups if their agent dies.

The kernel's parent-death signal (set by the bootstrap) kills a worker when its agent is
SIGKILLed, but not the worker's own children. The guard holds the read end of a pipe from
the agent; when the agent dies, however it dies, the pipe closes and the guard SIGKILLs
every process group the agent had registered. It imports nothing heavy and starts in ms.
"""

from __future__ import annotations

import subprocess
import sys

_GUARD = r"""
import os, signal, sys
groups = set()
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "watch":
        groups.add(int(arg))
    elif cmd == "forget":
        groups.discard(int(arg))
    elif cmd == "exit":
        sys.exit(0)
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class OrphanGuard:
    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _GUARD], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, start_new_session=True,  # survives a kill of our group
        )

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(f"{line}\n".encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def watch(self, pgid: int) -> None:
        self._send(f"watch {pgid}")

    def forget(self, pgid: int) -> None:
        self._send(f"forget {pgid}")

    def close(self) -> None:
        """Clean exit: the agent has stopped its workers itself."""
        self._send("exit")
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass
        self._proc.wait(timeout=10)
