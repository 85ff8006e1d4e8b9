"""The agent's side of a worker's heartbeat page (`control/heartbeat_page.py`, the layout).

The agent reads each worker's beats (its hang detection, its stall reports) and writes the
other direction: the switch target the leader asked for, and a spare's promotion.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from unbroken.control.heartbeat_page import (
    ALIVE_FORMAT,
    ALIVE_OFFSET,
    BEAT_FORMAT,
    DUMP_FORMAT,
    DUMP_OFFSET,
    DUMPED_OFFSET,
    GEN_FORMAT,
    GEN_OFFSET,
    SIZE,
    SPARE_PROMOTION,
    TARGET_OFFSET,
    Beat,
    settled,
)


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
                if os.fstat(fd).st_size < SIZE:
                    return None
                self._map = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
        # The worker may be stamping while we read: a read can pair a new pid with an old (at
        # first, zero) time. A settled read is whole, and a zero time is no stamp.
        raw = settled(lambda: self._map[:GEN_OFFSET])
        step, ns, phase, pid, progress = struct.unpack(BEAT_FORMAT, raw)
        if pid == 0 or ns == 0:
            return None
        (generation,) = struct.unpack_from(GEN_FORMAT, self._map, GEN_OFFSET)
        (alive,) = struct.unpack_from(ALIVE_FORMAT, self._map, ALIVE_OFFSET)
        return Beat(step=step, monotonic=ns / 1e9, phase=phase, pid=pid, generation=generation,
                    progress=progress, alive=alive / 1e9 if alive else None)

    def set_target(self, generation: int, step: int) -> bool:
        """Ask the worker to leave its generation at `step`; False until it has a heartbeat."""
        if self._map is None and self.read() is None:
            return False
        # The step first: a reader that sees the new generation sees its step too.
        words = memoryview(self._map).cast("q")
        words[TARGET_OFFSET // 8 + 1] = step
        words[TARGET_OFFSET // 8] = generation
        words.release()
        return True

    def ask_dump(self) -> int | None:
        """Ask the worker's watchdog to dump torch's flight recorder (where the worker turned
        it on); returns the count to wait for (`dump_served`), None without a heartbeat."""
        if self._map is None and self.read() is None:
            return None
        asked = struct.unpack_from(DUMP_FORMAT, self._map, DUMP_OFFSET)[0] + 1
        struct.pack_into(DUMP_FORMAT, self._map, DUMP_OFFSET, asked)
        return asked

    def dump_served(self, asked: int) -> bool:
        """The worker served the dump `ask_dump` returned `asked` for."""
        return self._map is not None and \
            struct.unpack_from(DUMP_FORMAT, self._map, DUMPED_OFFSET)[0] >= asked

    def promote(self, slot: int) -> bool:
        """Tell a waiting spare which slot it now fills."""
        return self.set_target(SPARE_PROMOTION, slot)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
