"""Worker heartbeat: a 32-byte memory-mapped file the worker stamps at every step boundary.

A stamp is two stores into shared memory (no syscall, well under a microsecond), so it is
invisible in step time; the agent reads the same page. The clock is CLOCK_MONOTONIC, which
is shared by all processes of a machine.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

_FORMAT = "<qqqq"  # step, monotonic_ns, phase, pid
_SIZE = struct.calcsize(_FORMAT)

PHASE_STARTING = 0  # process up, no step finished yet
PHASE_TRAINING = 1  # between or inside steps
PHASE_CHECKPOINT = 2  # inside a checkpoint save or load: may legitimately take long
PHASE_DONE = 3  # the training loop has finished


@dataclass(frozen=True)
class Beat:
    step: int
    monotonic: float
    phase: int
    pid: int


class HeartbeatWriter:
    """Owned by the worker runtime; `stamp` is called at every step boundary."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        self._pid = os.getpid()
        self.stamp(-1, PHASE_STARTING)

    def stamp(self, step: int, phase: int = PHASE_TRAINING) -> None:
        struct.pack_into(_FORMAT, self._map, 0, step, time.monotonic_ns(), phase, self._pid)


class HeartbeatReader:
    """Owned by the agent; `read` returns None until the worker has stamped once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._map: mmap.mmap | None = None

    def read(self) -> Beat | None:
        if self._map is None:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                if os.fstat(fd).st_size < _SIZE:
                    return None
                self._map = mmap.mmap(fd, _SIZE, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        step, ns, phase, pid = struct.unpack_from(_FORMAT, self._map, 0)
        if pid == 0:
            return None
        return Beat(step=step, monotonic=ns / 1e9, phase=phase, pid=pid)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
