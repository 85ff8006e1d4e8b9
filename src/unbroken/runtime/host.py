"""What the worker reads about its host from `/proc` (Linux), with portable fallbacks. Its
memory (`available_memory`) is `unbroken.host_memory`'s: the agent's health check reads it
too."""

from __future__ import annotations

import os
import time
from pathlib import Path

from unbroken.host_memory import available_memory  # noqa: F401  (the runtime's name for it)


def process_start_time() -> float | None:
    """Wall-clock time this process was started, to time imports and set-up; None where
    `/proc` cannot tell."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
