"""What the worker reads about its host from `/proc` (Linux), with portable fallbacks."""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_start_time() -> float | None:
    """Wall-clock time this process was started, to time imports and set-up; None where
    `/proc` cannot tell."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def available_memory() -> int:
    """Host memory the kernel can give without swapping (MemAvailable), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
