"""Decides when a worker that stopped stamping its heartbeat is hung.

Unless the user fixes a timeout, it is calibrated from the step times observed in this
attempt: `factor` times the slowest recent step, never below `floor`. A job with 50 ms steps
is declared hung after seconds, one with 10-minute steps is not killed in its sleep.
"""

from __future__ import annotations

from collections import deque

from unbroken.runtime.heartbeat import (
    PHASE_CHECKPOINT,
    PHASE_DONE,
    PHASE_RECOVERY,
    PHASE_STARTING,
    Beat,
)

_UNTIMED = (PHASE_STARTING, PHASE_RECOVERY)  # an interval from these is not a step time


class HangDetector:
    def __init__(
        self,
        fixed_timeout: float | None = None,
        startup_timeout: float = 600.0,
        checkpoint_timeout: float = 1800.0,
        floor: float = 5.0,
        factor: float = 10.0,
        window: int = 50,
    ) -> None:
        self.fixed_timeout = fixed_timeout
        self.startup_timeout = startup_timeout
        self.checkpoint_timeout = checkpoint_timeout
        self.floor = floor
        self.factor = factor
        self._intervals: deque[float] = deque(maxlen=window)
        self._last: Beat | None = None

    def observe(self, beat: Beat) -> None:
        last = self._last
        if last is not None and beat.step > last.step and last.phase not in _UNTIMED:
            self._intervals.append((beat.monotonic - last.monotonic) / (beat.step - last.step))
        if last is None or beat.step != last.step or beat.phase != last.phase:
            self._last = beat

    def step_timeout(self) -> float:
        """The timeout for a training step now; the startup timeout until one step is timed."""
        if self.fixed_timeout is not None:
            return self.fixed_timeout
        if not self._intervals:
            return self.startup_timeout
        return max(self.floor, self.factor * max(self._intervals))

    def overdue(self, now: float) -> float | None:
        """The timeout the worker has exceeded at monotonic time `now`, or None."""
        beat = self._last
        if beat is None or beat.phase == PHASE_DONE:
            return None
        if beat.phase == PHASE_STARTING:
            timeout = self.startup_timeout
        elif beat.phase in (PHASE_CHECKPOINT, PHASE_RECOVERY):
            timeout = self.checkpoint_timeout  # a recovery is bounded by the leader's watchdog
        else:
            timeout = self.step_timeout()
        return timeout if now - beat.monotonic > timeout else None

    @property
    def timed_steps(self) -> int:
        """How many step intervals were observed (0 until the worker completes a step)."""
        return len(self._intervals)

    @property
    def last_beat(self) -> Beat | None:
        return self._last
