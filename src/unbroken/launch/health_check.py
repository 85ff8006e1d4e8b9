"""A node checked before it joins: an agent runs these before it offers its node to the job
(a standby node before it offers its spares), never on a promotion's path.

- **memory**: the room under the cgroup's limit (a pod's), or the host's free memory,
  covers what the node's processes will hold in host copies (`--check-memory`, which
  `unbroken k8s` derives);
- **volume**: the checkpoint volume (`--check-dir`) takes a write at a stated speed
  (`--check-min-write` MB/s): 8 MiB quick, 64 MiB full, fsynced, then removed; the full
  write is spread over the nodes' start (node rank x 0.5 s, at most 30 s) so they do not
  all write at once;
- **gpus** (`--check-gpus N`): NVML sees at least N devices and answers for each;
- **collective** (full only): the node's local ranks all-reduce once, each in a process
  of its own (`health_selftest`), over gloo, or NCCL with GPUs.

A node that fails exits with the quarantine code, saying what failed in one line, and its
scheduler's policy acts (a JobSet counts it against the Job's backoffLimit). `plan` and
`refusal` are pure; the checks do the I/O.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from unbroken.host_memory import available_memory

MIB = 2**20
WRITE_BYTES = {"quick": 8 * MIB, "full": 64 * MIB}
STAGGER_S, STAGGER_MAX_S = 0.5, 30.0
SELFTEST_TIMEOUT_S = 60.0


class HealthMode(StrEnum):
    OFF = "off"
    """No check: the node joins as it is."""
    QUICK = "quick"
    """Memory, an 8 MiB write to the volume, the GPUs: under 10 s."""
    FULL = "full"
    """Quick, a 64 MiB write, and a collective self-test across the node's local ranks."""


@dataclass(frozen=True)
class HealthPlan:
    """What this node checks (`plan`)."""

    mode: HealthMode
    volume: Path | None
    write_bytes: int
    min_write_mbps: float
    memory_need: int | None
    gpus: int
    local_world: int
    stagger_s: float


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float


def plan(mode: HealthMode, *, volume: str | None, min_write_mbps: float,
         memory_need: int | None, gpus: int, local_world: int, node_rank: int) -> HealthPlan:
    """The checks of `mode` for this node. Pure."""
    full = mode == HealthMode.FULL
    return HealthPlan(mode, Path(volume) if volume else None,
                      WRITE_BYTES["full" if full else "quick"], min_write_mbps, memory_need,
                      gpus, local_world,
                      min(node_rank * STAGGER_S, STAGGER_MAX_S) if full else 0.0)


def refusal(checks: list[Check]) -> str | None:
    """The line a failed check gives (the first), or None. Pure."""
    failed = next((c for c in checks if not c.ok), None)
    if failed is None:
        return None
    return (f"health check failed: {failed.name}: {failed.detail}; this node does not join "
            "(exit 4: quarantined; run it elsewhere, or --health-check off)")


def run(p: HealthPlan) -> list[Check]:
    """Every check of the plan, in order; a failed one ends the list."""
    if p.mode == HealthMode.OFF:
        return []
    steps = [lambda: check_memory(p.memory_need)]
    if p.volume is not None:
        steps.append(lambda: check_volume(p.volume, p.write_bytes, p.min_write_mbps,
                                          p.stagger_s))
    if p.gpus:
        steps.append(lambda: check_gpus(p.gpus))
    if p.mode == HealthMode.FULL and p.local_world > 1:
        steps.append(lambda: check_collective(p.local_world, "nccl" if p.gpus else "gloo"))
    out: list[Check] = []
    for step in steps:
        out.append(step())
        if not out[-1].ok:
            break
    return out


def _timed(name: str, t0: float, ok: bool, detail: str) -> Check:
    return Check(name, ok, detail, round(time.monotonic() - t0, 3))


def check_memory(need: int | None) -> Check:
    t0 = time.monotonic()
    have = available_memory()
    if need is None:
        return _timed("memory", t0, True, f"{have / 2**30:.1f} GiB free (no need given)")
    ok = have >= need
    return _timed("memory", t0, ok, f"{have / 2**30:.1f} GiB free under the limit, "
                  f"{need / 2**30:.1f} GiB needed for the host copies"
                  + ("" if ok else " (raise the pod's memory, or lower --check-memory)"))


def check_volume(path: Path, nbytes: int, min_mbps: float, stagger_s: float = 0.0) -> Check:
    """`nbytes` written to a temporary file in `path`, fsynced, timed, removed."""
    if stagger_s > 0:
        time.sleep(stagger_s)
    t0 = time.monotonic()
    name = f"volume {path}"
    try:
        fd, tmp = tempfile.mkstemp(prefix=".unbroken-health-", dir=path)
    except OSError as exc:
        return _timed(name, t0, False, f"not writable ({exc.strerror or exc})")
    try:
        block = os.urandom(MIB)
        written = 0
        while written < nbytes:
            written += os.write(fd, block[: min(MIB, nbytes - written)])
        os.fsync(fd)
    except OSError as exc:
        return _timed(name, t0, False, f"a write failed ({exc.strerror or exc})")
    finally:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
    seconds = max(time.monotonic() - t0, 1e-6)
    mbps = nbytes / 1e6 / seconds
    ok = mbps >= min_mbps
    return _timed(name, t0, ok, f"{nbytes // MIB} MiB at {mbps:.0f} MB/s"
                  + ("" if ok else f", below the {min_mbps:g} MB/s asked (--check-min-write)"))


def check_gpus(expected: int) -> Check:
    """NVML (libnvidia-ml, the driver's) sees `expected` devices and answers for each."""
    t0 = time.monotonic()
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return _timed("gpus", t0, False, f"{expected} GPU(s) expected, but the driver's NVML "
                      "library (libnvidia-ml.so.1) is not here")
    if nvml.nvmlInit_v2() != 0:
        return _timed("gpus", t0, False, "NVML did not initialise: the driver is not loaded")
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value < expected:
            return _timed("gpus", t0, False,
                          f"{count.value} GPU(s) visible, {expected} expected")
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                return _timed("gpus", t0, False, f"GPU {i} does not answer NVML")
        return _timed("gpus", t0, True, f"{count.value} GPU(s) answer")
    finally:
        nvml.nvmlShutdown()


def check_collective(world: int, backend: str) -> Check:
    """`world` processes on this node all-reduce once (`health_selftest`)."""
    t0 = time.monotonic()
    name = f"collective ({backend}, {world} ranks)"
    with tempfile.TemporaryDirectory(prefix="unbroken-selftest-") as tmp:
        store = str(Path(tmp) / "store")
        procs = [subprocess.Popen([sys.executable, "-m", "unbroken.launch.health_selftest",
                                   store, str(rank), str(world), backend],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for rank in range(world)]
        errors = []
        for proc in procs:
            try:
                _, err = proc.communicate(timeout=max(1.0, SELFTEST_TIMEOUT_S
                                                      - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                return _timed(name, t0, False, f"no answer in {SELFTEST_TIMEOUT_S:g} s")
            if proc.returncode != 0:
                errors.append((err.strip().splitlines() or ["?"])[-1])
    if errors:
        return _timed(name, t0, False, errors[0])
    return _timed(name, t0, True, "all-reduced")
