"""Starting, watching and stopping one node's worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.control.messages import Fault
from unbroken.launch.workers.hang_detector import HangDetector
from unbroken.launch.workers.heartbeat_reader import HeartbeatReader
from unbroken.launch.workers.worker_logs import WorkerStreams


@dataclass
class WorkerProcess:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    heartbeat: HeartbeatReader
    hang: HangDetector
    error_file: Path
    pidfd: int | None = None
    wid: str = ""  # worker id: "<slot>.<incarnation>"; a replacement is a new incarnation
    fault: Fault | None = None  # set when the agent killed it (a hang), to name the cause
    torchelastic_error_file: Path | None = None  # where torchrun's @record writes its error

    def error(self) -> dict | None:
        """Its error report: the bootstrap's, else the one torchrun's `@record` wrote
        (TORCHELASTIC_ERROR_FILE, also written by a --no-python program's Python child)."""
        return read_error(self.error_file) or (
            read_torchelastic_error(self.torchelastic_error_file)
            if self.torchelastic_error_file else None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.heartbeat.close()


BOOTSTRAP = [sys.executable, "-u", "-m", "unbroken.worker"]


def script_argv(script: str, args: list[str], module: bool) -> list[str]:
    """What the bootstrap is told to run: `SCRIPT ARGS` or `-m MODULE ARGS`."""
    return ["-m", script, *args] if module else [script, *args]


def worker_command(script: str, args: list[str], module: bool, no_python: bool) -> list[str]:
    if no_python:
        return [script, *args]
    return [*BOOTSTRAP, *script_argv(script, args, module)]


def spawn(cmd: list[str], env: dict[str, str], streams: WorkerStreams | None) -> subprocess.Popen:
    """Start a worker in its own session, so that stopping it also stops its children.
    `streams`: where its stdout and stderr go (None, or a None stream: the agent's own)."""
    files = [open(path, "ab") if path else None  # noqa: SIM115 - handed to the child
             for path in ((streams.stdout, streams.stderr) if streams else (None, None))]
    try:
        return subprocess.Popen(
            cmd, env=env, stdout=files[0], stderr=files[1], stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        for f in files:
            if f:
                f.close()


def open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal a worker's process group (it and its children); the worker alone if that fails."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def stop_workers(workers: list[WorkerProcess], grace: float) -> None:
    """SIGTERM, then SIGKILL whatever is left after `grace` seconds; reaps every process."""
    alive = [w for w in workers if w.proc.poll() is None]
    for w in alive:
        signal_group(w.proc, signal.SIGTERM)
        signal_group(w.proc, signal.SIGCONT)  # a stopped process only dies once continued
    deadline = time.monotonic() + grace
    for w in alive:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for w in workers:
        # The whole group, also when the leader exited: its children may still run.
        signal_group(w.proc, signal.SIGKILL)
    for w in workers:
        try:
            w.proc.wait(timeout=max(grace, 5.0))
        except subprocess.TimeoutExpired:
            # Stuck in the kernel (a driver, NFS): never block the agent on it. It stays
            # SIGKILLed; the orphan guard still holds its process group.
            pass


def describe_exit(returncode: int) -> tuple[str, str]:
    """(fault kind, human detail) for a worker's non-zero exit."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return "crash", f"killed by {name}"
    return "exit", f"exited with code {returncode}"


def read_torchelastic_error(path: Path) -> dict | None:
    """torchrun's error file (`{"message": {"message": "Type: text", "extraInfo":
    {"py_callstack": ..., "timestamp": ...}}}`) as the bootstrap's record; None if absent.
    It is data: parsed as JSON, never evaluated."""
    record = read_error(path)
    message = record.get("message") if isinstance(record, dict) else None
    if isinstance(message, str):  # a plain message, as some writers leave it
        message = {"message": message}
    if not isinstance(message, dict):
        return None
    text = str(message.get("message", ""))
    kind, sep, rest = text.partition(": ")
    info = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
    return {"type": kind if sep else "Error", "message": rest if sep else text,
            "traceback": str(info.get("py_callstack", ""))}


def read_error(path: Path) -> dict | None:
    """The traceback record the bootstrap wrote, or None."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def normal_priority(pid: int) -> None:
    """A spare under SCHED_IDLE would starve behind training once it is promoted: give it,
    every thread of it, normal priority now."""
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

