"""A benchmark stopped by SIGTERM (as a CI timeout stops it) leaves no process behind:
benchmarks/harness.py ends every arm it launched, workers included, and exits 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import EXAMPLE, REPO, alive, processes_mentioning, wait_for


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def test_a_benchmark_stopped_by_sigterm_leaves_no_process(tmp_path):
    """recovery.py at its smallest; once an arm's launcher and both its workers run, SIGTERM
    the benchmark: within 60 s it has exited 143 and no process that mentions its temp root
    (its run dirs live there: TMPDIR) is alive."""
    root = str(tmp_path)
    out = tmp_path / "benchmark.out"
    with open(out, "wb") as log:
        bench = subprocess.Popen(
            [sys.executable, str(REPO / "benchmarks" / "recovery.py"), "--tries", "1",
             "--workers", "2", "--rounds", "0"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
            env={**os.environ, "TMPDIR": root})

    def arm() -> list[int]:
        return [p for p in processes_mentioning(root)
                if p != bench.pid and alive(p) and str(EXAMPLE) in _cmdline(p)]

    def leftovers() -> list[int]:
        return [p for p in processes_mentioning(root) if p != bench.pid and alive(p)]

    try:
        wait_for(lambda: len(arm()) >= 3 or bench.poll() is not None, 240,
                 "an arm's launcher and its 2 workers")
        assert bench.poll() is None, out.read_text()
        os.kill(bench.pid, signal.SIGTERM)
        try:
            code = bench.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the benchmark did not exit within 60 s of SIGTERM") from None
        deadline = time.monotonic() + 5  # killed processes are reaped by their new parent
        while leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: _cmdline(p) for p in leftovers()}
        assert not left, f"processes outlived the benchmark: {left}"
        assert code == 128 + signal.SIGTERM, (code, out.read_text())
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        for pid in leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
