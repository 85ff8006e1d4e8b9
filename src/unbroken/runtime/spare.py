"""A hot spare's wait: warmed up, it waits to be promoted into a failed worker's slot.

The agent writes the slot into the spare's heartbeat page (shared memory: an idle spare
costs no system call and no store round trip); the spare also looks, once a second, whether
the job has finished without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from unbroken.runtime.heartbeat import PHASE_SPARE_READY, HeartbeatWriter

_POLL = 0.002  # seconds between looks at the heartbeat page
_JOB_CHECK = 1.0  # seconds between looks at the store


def await_promotion(heartbeat: HeartbeatWriter, finished: Callable[[], bool]) -> int | None:
    """The slot this spare was promoted into, or None if the job finished first.

    Stamps the heartbeat as `PHASE_SPARE_READY` meanwhile, so that the agent can offer it."""
    heartbeat.stamp(-1, PHASE_SPARE_READY)
    checked = time.monotonic()
    while (slot := heartbeat.promotion()) is None:
        time.sleep(_POLL)
        if time.monotonic() - checked > _JOB_CHECK:
            checked = time.monotonic()
            heartbeat.stamp(-1, PHASE_SPARE_READY)
            if finished():
                return None
    return slot
