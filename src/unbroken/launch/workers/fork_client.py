"""The agent's side of its node's fork server (`runtime/fork_server.py`; the protocol:
`control/fork_requests.py`): start it, ask it for workers, and watch what it forks.

The agent makes itself the child subreaper first, so that each forked worker (the server
forks it through an intermediate child that exits at once) becomes the agent's child: the
agent reaps it, gets its exit status, and sees it as a torchrun agent sees its workers. A
forked worker comes back as a `ForkedProcess`, which answers what the supervisor asks of a
`subprocess.Popen` (`pid`, `poll`, `wait`, `send_signal`, `kill`, `returncode`).

The server's death kills no worker (they are the agent's): the agent says so in one line
and an event, starts a new server and spawns cold until it is ready; a second death turns
the server off for the job. A request the server refuses (an unsafe fork) is started cold,
said once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from unbroken.control.codec import decode, encode
from unbroken.control.fork_requests import (
    ARGV_PAD,
    ENV_PAD,
    FORK_SERVER_FLAG,
    PAD_VARIABLE,
    SOCKET_VARIABLE,
    ForkReply,
    ForkRequest,
    load_time_differences,
)
from unbroken.kinship import become_subreaper
from unbroken.launch.workers.orphan_guard import OrphanGuard
from unbroken.launch.workers.worker_logs import WorkerStreams
from unbroken.launch.workers.worker_process import BOOTSTRAP
from unbroken.telemetry import schema as ev

FIRST_READY = 120.0
"""Seconds the first worker waits for the server's imports (about 3 s idle; more on a loaded
machine); past it, that worker starts cold."""
REPLY_BOUND = 30.0  # seconds a fork's answer may take before the server counts as dead
_LOOK = 0.01


class ForkedProcess:
    """A worker the server forked, reparented to the agent: the `Popen` calls the supervisor
    makes, over `os.waitpid` (the agent is its parent)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(_LOOK)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """This node's fork server, as the agent holds it (see the module's docstring).
    `env` is the server's environment (the workers' without rank or attempt)."""

    def __init__(self, env: dict[str, str], node_dir: Path, guard: OrphanGuard,
                 say: Callable[[str], None], record: Callable[..., object]) -> None:
        self.env, self.guard, self.say, self.record = env, guard, say, record
        self.path = node_dir / "fork.sock"
        self.deaths = 0
        self.off: str | None = None  # why the server is off for the job
        self._refused: set[str] = set()
        self._conn: socket.socket | None = None
        self._replies = None
        self._first = True
        become_subreaper()
        self._start()

    def _start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        env = {**self.env, SOCKET_VARIABLE: str(self.path), PAD_VARIABLE: "." * ENV_PAD,
               "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        self._started_with = env
        self.proc = subprocess.Popen([*BOOTSTRAP, FORK_SERVER_FLAG, " " * ARGV_PAD], env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.guard.watch(self.proc.pid)
        self.started = time.monotonic()

    def _connect(self, wait: float) -> bool:
        """Connected to the server, waiting up to `wait` seconds for it to listen."""
        if self._conn is not None:
            return True
        deadline = time.monotonic() + wait
        while True:
            if self.proc.poll() is not None:
                self._lost(f"exited with {self.proc.returncode} before it listened")
                return False
            if self.path.exists():
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    conn.connect(str(self.path))
                except OSError:
                    conn.close()
                else:
                    conn.settimeout(REPLY_BOUND)
                    self._conn, self._replies = conn, conn.makefile("rb")
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_LOOK)

    def spawn(self, env: dict[str, str], argv: list[str],
              streams: WorkerStreams | None) -> ForkedProcess | None:
        """A worker forked with `env`, running `python -m unbroken.worker ARGV`; None when
        it must start cold (the server is off, not ready, or refused: said)."""
        if self.off is not None:
            return None
        differ = load_time_differences(self._started_with, env)
        if differ:
            self._refuse(f"{', '.join(differ)} differ from the server's: they are read at load")
            return None
        wait, self._first = (FIRST_READY if self._first else 0.0), False
        if not self._connect(wait):
            return None
        request = ForkRequest(env=env, argv=argv, cwd=os.getcwd(),
                              stdout=streams.stdout if streams else None,
                              stderr=streams.stderr if streams else None)
        try:
            self._conn.sendall(encode(request).encode() + b"\n")
            line = self._replies.readline()
        except OSError as exc:
            line, why = b"", f"{type(exc).__name__}: {exc}"
        else:
            why = "closed its socket"
        if not line:
            self._lost(why)
            return None
        reply = decode(ForkReply, line.decode())
        if reply.pid is None:
            self._refuse(reply.error or "no reason given")
            return None
        return ForkedProcess(reply.pid, [*BOOTSTRAP, *argv])

    def _refuse(self, why: str) -> None:
        """A worker starts cold: said once per reason."""
        if why not in self._refused:
            self._refused.add(why)
            self.say(f"fork server: {why}; workers start cold meanwhile")

    def _lost(self, why: str) -> None:
        """The server died: its workers live on. Once: a new one; twice: off for the job."""
        self._close_conn()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.guard.forget(self.proc.pid)
        self.deaths += 1
        again = self.deaths < 2
        self.record(ev.ForkServerLost(pid=self.proc.pid, error=why, restarted=again))
        self.say(f"fork server (pid {self.proc.pid}) {why}: its workers run on; "
                 + ("a new one starts, workers start cold until it is ready" if again
                    else "it is off for the job: workers start cold"))
        if again:
            self._start()
        else:
            self.off = why

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._replies.close()
            self._conn.close()
            self._conn = self._replies = None

    def close(self) -> None:
        """Stop the server (its workers are the agent's and unaffected)."""
        self._close_conn()
        if self.off is None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.guard.forget(self.proc.pid)
        self.path.unlink(missing_ok=True)
