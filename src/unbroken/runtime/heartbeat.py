"""Worker heartbeat: a small memory-mapped file shared by a worker and its agent.

The worker stamps (step, time, phase) at every step boundary: stores into shared memory, no
syscall, well under a microsecond, so invisible in step time. The clock is CLOCK_MONOTONIC,
shared by all processes of a machine. The same page carries the other direction too: the
generation the worker is in (-1 until it runs the resilient loop) and the generation the agent
wants it to move to, with the step at which to move, read by the worker at each boundary and
by its watchdog thread (which aborts the generation's groups if the move is due mid-step).

Two more worker fields let the leader blame a hang on the right rank (`launch/culprit.py`):
- `progress`: a counter the worker bumps at points inside a step (0 at the step's start; the
  model's forward entered, then returned: the gradient collective follows). Ranks of one
  generation pass the same points, so a rank whose (step, progress) is behind the others',
  while they wait, is the one they wait for.
- `alive`: the time the worker's watchdog thread last ran. A process whose every thread is
  stopped (SIGSTOP, a frozen host) stops it; one blocked in a collective does not.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_FORMAT = "<qqqqq"  # step, monotonic_ns, phase, pid, progress: written by the worker
_PROGRESS_OFFSET = struct.calcsize("<qqqq")  # the last field of _FORMAT, bumped on its own
_GEN_FORMAT = "<q"  # the generation the worker is in: written by the worker
_TARGET_FORMAT = "<qq"  # generation to move to, and from which step: written by the agent
_ALIVE_FORMAT = "<q"  # monotonic_ns of the watchdog thread's last run: written by the worker
_GEN_OFFSET = struct.calcsize(_FORMAT)
_TARGET_OFFSET = _GEN_OFFSET + struct.calcsize(_GEN_FORMAT)
_ALIVE_OFFSET = _TARGET_OFFSET + struct.calcsize(_TARGET_FORMAT)
_SIZE = _ALIVE_OFFSET + struct.calcsize(_ALIVE_FORMAT)

PHASE_STARTING = 0  # process up, no step finished yet
PHASE_TRAINING = 1  # between or inside steps
PHASE_CHECKPOINT = 2  # inside a checkpoint save or load: may legitimately take long
PHASE_DONE = 3  # the training loop has finished
PHASE_RECOVERY = 4  # re-forming the group in place: bounded by the leader, not by step time
PHASE_SPARE_READY = 5  # a hot spare, warmed up, waiting to be promoted
PHASE_LONG = 6  # a phase the script declared long (`run.phase("eval")`): no step timeout
STEPPING = (PHASE_TRAINING, PHASE_LONG)  # inside the training loop, between two boundaries
# In the target's step field: leave at once (the leader broke the generation), which the
# watchdog acts on mid-step; a step >= 0 is a planned switch, made at that step boundary.
LEAVE_NOW = -1
# In a spare's target field, this generation means "promoted": the step field is its slot.
# Shared memory, so that an idle spare waits without a system call or a store round trip.
SPARE_PROMOTION = -2


def _settled(read: Callable[[], T]) -> T:
    """`read()` until two reads in a row agree: the other side may be writing the fields,
    which are not written at once, and stores reach us in program order."""
    seen = read()
    for _ in range(100):
        again = read()
        if again == seen:
            break
        seen = again
    return seen


@dataclass(frozen=True)
class Beat:
    step: int
    monotonic: float
    phase: int
    pid: int
    generation: int = -1
    progress: int = 0  # points passed inside the step (see the module docstring)
    alive: float | None = None  # monotonic time the watchdog last ran; None: no watchdog


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
        struct.pack_into(_GEN_FORMAT, self._map, _GEN_OFFSET, -1)
        struct.pack_into(_TARGET_FORMAT, self._map, _TARGET_OFFSET, -1, 0)
        struct.pack_into(_ALIVE_FORMAT, self._map, _ALIVE_OFFSET, 0)
        self._words = memoryview(self._map).cast("q")  # aligned 8-byte stores, each whole
        self._progress = 0
        self.phase = PHASE_STARTING
        self.stamp(-1, PHASE_STARTING)

    def stamp(self, step: int, phase: int = PHASE_TRAINING) -> None:
        """A step boundary or a change of phase: the progress counter starts again at 0."""
        self._progress = 0
        self.phase = phase
        struct.pack_into(_FORMAT, self._map, 0, step, time.monotonic_ns(), phase, self._pid, 0)

    def advance(self) -> None:
        """One more point passed inside the step (one aligned 8-byte store: the step and its
        time are left as they are, so the hang timeout still runs from the step's start)."""
        self._progress += 1
        self._words[_PROGRESS_OFFSET // 8] = self._progress

    def tick(self) -> None:
        """The watchdog thread ran: this process is not stopped."""
        self._words[_ALIVE_OFFSET // 8] = time.monotonic_ns()

    def set_generation(self, generation: int) -> None:
        struct.pack_into(_GEN_FORMAT, self._map, _GEN_OFFSET, generation)

    def target(self) -> tuple[int, int]:
        """(generation, step): the agent asks the worker to leave its generation at that step
        (`LEAVE_NOW`: at once)."""
        return _settled(lambda: struct.unpack_from(_TARGET_FORMAT, self._map, _TARGET_OFFSET))

    def switch_asked(self, gen: int, step: int) -> bool:
        """The leader asked (`target`) for a switch past generation `gen` at `step` or
        before."""
        target_gen, at_step = self.target()
        return target_gen > gen and step >= at_step

    def promotion(self) -> int | None:
        """A spare's slot, once its agent has promoted it."""
        gen, slot = self.target()
        return slot if gen == SPARE_PROMOTION else None


class HeartbeatReader:
    """Owned by the agent; `read` returns None until the worker has stamped once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._map: mmap.mmap | None = None

    def read(self) -> Beat | None:
        if self._map is None:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                return None
            try:
                if os.fstat(fd).st_size < _SIZE:
                    return None
                self._map = mmap.mmap(fd, _SIZE)
            finally:
                os.close(fd)
        # The worker may be stamping while we read: a read can pair a new pid with an old (at
        # first, zero) time. A settled read is whole, and a zero time is no stamp.
        raw = _settled(lambda: self._map[:_GEN_OFFSET])
        step, ns, phase, pid, progress = struct.unpack(_FORMAT, raw)
        if pid == 0 or ns == 0:
            return None
        (generation,) = struct.unpack_from(_GEN_FORMAT, self._map, _GEN_OFFSET)
        (alive,) = struct.unpack_from(_ALIVE_FORMAT, self._map, _ALIVE_OFFSET)
        return Beat(step=step, monotonic=ns / 1e9, phase=phase, pid=pid, generation=generation,
                    progress=progress, alive=alive / 1e9 if alive else None)

    def set_target(self, generation: int, step: int) -> bool:
        """Ask the worker to leave its generation at `step`; False until it has a heartbeat."""
        if self._map is None and self.read() is None:
            return False
        # The step first: a reader that sees the new generation sees its step too.
        words = memoryview(self._map).cast("q")
        words[_TARGET_OFFSET // 8 + 1] = step
        words[_TARGET_OFFSET // 8] = generation
        words.release()
        return True

    def promote(self, slot: int) -> bool:
        """Tell a waiting spare which slot it now fills."""
        return self.set_target(SPARE_PROMOTION, slot)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
