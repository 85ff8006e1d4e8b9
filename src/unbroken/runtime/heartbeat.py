"""The worker's side of its heartbeat page (`control/heartbeat_page.py`, the layout).

The worker stamps (step, time, phase) at every step boundary, bumps its progress inside a
step, and its watchdog thread ticks `alive`; it reads the switch target its agent mirrors
from the leader, and, as a spare, its promotion. The agent's side is
`launch/workers/heartbeat_reader.py`.

The page's names (phases, `LEAVE_NOW`, `SPARE_PROMOTION`, `Beat`, ...) are re-exported here:
the runtime imports them from this module.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

from unbroken.control.heartbeat_page import (
    ALIVE_FORMAT,
    ALIVE_OFFSET,
    BEAT_FORMAT,
    DUMP_FORMAT,
    DUMP_OFFSET,
    DUMPED_OFFSET,
    GEN_FORMAT,
    GEN_OFFSET,
    LEAVE_NOW,
    PHASE_CHECKPOINT,
    PHASE_DONE,
    PHASE_LONG,
    PHASE_RECOVERY,
    PHASE_SPARE_READY,
    PHASE_STARTING,
    PHASE_TRAINING,
    PROGRESS_OFFSET,
    SIZE,
    SPARE_PROMOTION,
    STEPPING,
    TARGET_FORMAT,
    TARGET_OFFSET,
    Beat,
    settled,
)

__all__ = [
    "LEAVE_NOW", "PHASE_CHECKPOINT", "PHASE_DONE", "PHASE_LONG", "PHASE_RECOVERY",
    "PHASE_SPARE_READY", "PHASE_STARTING", "PHASE_TRAINING", "SPARE_PROMOTION", "STEPPING",
    "Beat", "HeartbeatWriter",
]


class HeartbeatWriter:
    """Owned by the worker runtime; `stamp` is called at every step boundary."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._pid = os.getpid()
        struct.pack_into(GEN_FORMAT, self._map, GEN_OFFSET, -1)
        struct.pack_into(TARGET_FORMAT, self._map, TARGET_OFFSET, -1, 0)
        struct.pack_into(ALIVE_FORMAT, self._map, ALIVE_OFFSET, 0)
        struct.pack_into(DUMP_FORMAT, self._map, DUMPED_OFFSET, 0)
        self._words = memoryview(self._map).cast("q")  # aligned 8-byte stores, each whole
        self._progress = 0
        self.phase = PHASE_STARTING
        self.stamp(-1, PHASE_STARTING)

    def stamp(self, step: int, phase: int = PHASE_TRAINING) -> None:
        """A step boundary or a change of phase: the progress counter starts again at 0."""
        self._progress = 0
        self.phase = phase
        struct.pack_into(BEAT_FORMAT, self._map, 0, step, time.monotonic_ns(), phase, self._pid, 0)

    def advance(self) -> None:
        """One more point passed inside the step (one aligned 8-byte store: the step and its
        time are left as they are, so the hang timeout still runs from the step's start)."""
        self._progress += 1
        self._words[PROGRESS_OFFSET // 8] = self._progress

    def tick(self) -> None:
        """The watchdog thread ran: this process is not stopped."""
        self._words[ALIVE_OFFSET // 8] = time.monotonic_ns()

    def set_generation(self, generation: int) -> None:
        struct.pack_into(GEN_FORMAT, self._map, GEN_OFFSET, generation)

    def target(self) -> tuple[int, int]:
        """(generation, step): the agent asks the worker to leave its generation at that step
        (`LEAVE_NOW`: at once)."""
        return settled(lambda: struct.unpack_from(TARGET_FORMAT, self._map, TARGET_OFFSET))

    def switch_asked(self, gen: int, step: int) -> bool:
        """The leader asked (`target`) for a switch past generation `gen` at `step` or
        before."""
        target_gen, at_step = self.target()
        return target_gen > gen and step >= at_step

    def dump_asked(self) -> int | None:
        """The count of flight-recorder dumps the agent asked for, if more than were served
        (`dumped`); None otherwise."""
        asked = struct.unpack_from(DUMP_FORMAT, self._map, DUMP_OFFSET)[0]
        served = struct.unpack_from(DUMP_FORMAT, self._map, DUMPED_OFFSET)[0]
        return asked if asked > served else None

    def dumped(self, asked: int) -> None:
        """Dumps up to `asked` are served (written, or nothing to write)."""
        struct.pack_into(DUMP_FORMAT, self._map, DUMPED_OFFSET, asked)

    def promotion(self) -> int | None:
        """A spare's slot, once its agent has promoted it."""
        gen, slot = self.target()
        return slot if gen == SPARE_PROMOTION else None
