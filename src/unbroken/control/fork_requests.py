"""The fork server's protocol, declared once for both sides: the agent asks
(`launch/workers/fork_client.py`), the server forks (`runtime/fork_server.py`).

One Unix socket per node, in the node's run directory, owner-only (0600), one connection:
the agent's. Each request is one JSON line (`ForkRequest`), each answer one JSON line
(`ForkReply`), in order. The server forks only what its agent asks, runs nothing a request
contains but the worker's own command (`argv`, as `python -m unbroken.worker ARGV` would),
and exits when the connection closes.
"""

from __future__ import annotations

from dataclasses import dataclass

FORK_SERVER_FLAG = "--fork-server"
"""`python -m unbroken.worker --fork-server`: the node's fork server."""

SOCKET_VARIABLE = "UNBROKEN_FORK_SOCKET"
"""Where the server listens (set by the agent in the server's environment only)."""

PAD_VARIABLE = "UNBROKEN_FORK_PAD"
"""Padding in the server's environment block, which each child overwrites with its own
environment, so that `/proc/PID/environ` shows the rank's variables (as setproctitle does
for the command line)."""

ARGV_PAD = 4096
"""Bytes of padding after the server's own command line, for each child's `python SCRIPT
ARGS`."""

ENV_PAD = 65536
"""Bytes of padding in the server's environment block (`PAD_VARIABLE`)."""


@dataclass
class ForkRequest:
    """Fork one worker or spare: its whole environment, its command after `python -m
    unbroken.worker`, its output files (None: the agent's own streams), its working
    directory."""

    env: dict[str, str]
    argv: list[str]
    stdout: str | None = None
    stderr: str | None = None
    cwd: str | None = None


@dataclass
class ForkReply:
    """The child's pid (a child of the agent, which is its subreaper), or why none was
    forked (the agent then starts that worker cold, and says so)."""

    pid: int | None = None
    error: str | None = None


LOAD_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "PYTHON")
"""Variables read once, when the interpreter or a native library loads (the thread pools of
OpenMP, MKL and OpenBLAS; the interpreter's own `PYTHON*`): the fork server has read its
own, and a forked child cannot read them again."""


def load_time_differences(server: dict[str, str], worker: dict[str, str]) -> list[str]:
    """The load-time variables (`LOAD_TIME_PREFIXES`) whose value in a worker's environment
    is not the server's (set in one only, included): where any is, that worker starts as a
    fresh interpreter, which reads them."""
    names = {k for k in (*server, *worker) if k.startswith(LOAD_TIME_PREFIXES)}
    return sorted(k for k in names if server.get(k) != worker.get(k))
