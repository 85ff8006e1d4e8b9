"""What the launcher benchmarks share: ports, event logs, and leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_everything(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL a launcher's process group and every process started for `run_dir`."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    marker = f"UNBROKEN_RUN_DIR={run_dir}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass
    proc.wait()


class EventTail:
    """The events appended since the last call: polling must not steal the CPU it measures."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "events.jsonl"
        self.offset = 0
        self.partial = b""
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        self.events += new
        return new


def step_period(ends: list[float], least: int = 21) -> float | None:
    """The median time between consecutive step ends (the steady state's seconds per step,
    the loop's work between steps included); None with fewer than `least` gaps."""
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return statistics.median(gaps) if gaps and len(gaps) >= least else None


def epoch(e: dict) -> tuple[int, int]:
    """Which incarnation of the job computed a step: (attempt, generation)."""
    return e.get("attempt", 0), e.get("gen", 0)


def wait_for_victim(proc: subprocess.Popen, tail: EventTail, kill_at: int, rank: int,
                    timeout: float, ready: Callable[[list[dict]], bool] = lambda events: True,
                    ) -> int | None:
    """The pid of `rank`'s worker once training has passed step `kill_at` and `ready(events)`
    holds; None if the launcher exits or `timeout` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tail.poll()
        if ready(tail.events) and any(e["event"] == "step" and e["step"] >= kill_at
                                      for e in tail.events):
            return [e["pid"] for e in tail.events
                    if e["event"] == "worker_start" and e["rank"] == rank][-1]
        if proc.poll() is not None:
            return None
        time.sleep(0.02)
    return None


def kill_and_time(proc: subprocess.Popen, tail: EventTail, victim: int,
                  hang_after: float) -> tuple[float, dict | str | None]:
    """SIGKILL `victim`, then wait for the first step the recovered job completes (a later
    attempt or generation). Returns (kill time, that step's event); instead of the event,
    None for a hang, or a string if the launcher exited without resuming."""
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    before = max((epoch(e) for e in tail.events if e["event"] == "step"), default=(0, 0))
    deadline = time.monotonic() + hang_after
    while time.monotonic() < deadline:
        resumed = next((e for e in tail.poll() if e["event"] == "step"
                        and e["t"] > killed_at and epoch(e) > before), None)
        if resumed is not None:
            return killed_at, resumed
        if proc.poll() is not None:
            return killed_at, f"exited {proc.returncode} without resuming"
        time.sleep(0.005)
    return killed_at, None
