"""The memory a process can still take, where its cgroup's limit (a pod's) is lower than the
host's free memory: the runtime's host-copy budget and the agent's health check read it.
Linux `/proc` and `/sys/fs/cgroup`, with a portable fallback."""

from __future__ import annotations

import os
from pathlib import Path


def available_memory() -> int:
    """Memory this process's cgroup can still take without swapping, in bytes: the host's
    MemAvailable, or less where the cgroup's limit leaves less (a pod's memory limit: the
    kernel kills the container at its limit, whatever the host has free)."""
    host = _mem_available()
    room = cgroup_room()
    return min(host, room) if room is not None else host


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_room(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
                ) -> int | None:
    """The room left under this process's cgroup memory limit (limit minus usage, the
    nearest limited ancestor's), or None where no limit applies or none can be read.
    cgroup v2 (`memory.max`, `memory.current`) and v1 (`memory.limit_in_bytes`,
    `memory.usage_in_bytes`)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # v2: the unified hierarchy
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1: the memory controller's
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            root = root / "memory" if (root / "memory").is_dir() else root
        else:
            continue
        room = _room(root, path.lstrip("/"), files)
        if room is not None:
            return room
    return None


def _room(root: Path, path: str, files: tuple[str, str]) -> int | None:
    """From the cgroup at `path` up to the root: the first limit that is one."""
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        d = root.joinpath(*parts[:depth])
        try:
            limit = (d / files[0]).read_text().strip()
            usage = int((d / files[1]).read_text().strip())
        except (OSError, ValueError):
            continue  # inside a container the path may not exist: its root is the cgroup
        if limit != "max" and int(limit) < 2**60:  # v1's "no limit" is a huge number
            return max(0, int(limit) - usage)
    return None
