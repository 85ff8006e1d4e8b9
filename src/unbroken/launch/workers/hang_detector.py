"""Decides when a worker that stopped stamping its heartbeat is stalled.

Unless the user fixes a timeout, it is calibrated from the step times observed in this
attempt: `factor` (3) times the 99th percentile of the recent steps, never below `floor`
(1 s). A job with 50 ms steps is declared stalled after a second, one with 10-minute steps
is not killed in its sleep, and a step 3 times slower than usual now and then (jitter, a
recompile) is not a hang. A phase the script declares long (`run.phase("eval")`) has no step
timeout, and the time it took is no step time.

Who is to blame for a stall is not decided here: in place, the leader compares every rank's
progress (`launch/planning/culprit.py`); without in-place recovery, the node kills its stalled worker.
"""

from __future__ import annotations

from collections import deque

from unbroken.control.heartbeat_page import (
    PHASE_CHECKPOINT,
    PHASE_DONE,
    PHASE_LONG,
    PHASE_RECOVERY,
    PHASE_STARTING,
    Beat,
)

# An interval from these is no step time.
_UNTIMED = (PHASE_STARTING, PHASE_RECOVERY, PHASE_LONG, PHASE_CHECKPOINT)
DEFAULT_FLOOR = 1.0
DEFAULT_FACTOR = 3.0
FIRST_STEP_FACTOR = 5.0  # the first step after a start or a recovery (DDP rebuckets, caches warm)


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values` (nearest rank); `values` must not be empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))]


class HangDetector:
    def __init__(
        self,
        fixed_timeout: float | None = None,
        startup_timeout: float = 600.0,
        checkpoint_timeout: float = 1800.0,
        floor: float = DEFAULT_FLOOR,
        factor: float = DEFAULT_FACTOR,
        window: int = 200,
    ) -> None:
        self.fixed_timeout = fixed_timeout
        self.startup_timeout = startup_timeout
        self.checkpoint_timeout = checkpoint_timeout
        self.floor = floor
        self.factor = factor
        self._intervals: deque[float] = deque(maxlen=window)
        self._timeout: float | None = None  # cached until the next interval
        self._last: Beat | None = None
        self._first_step = False  # the step under way is the first after a start or recovery

    def observe(self, beat: Beat) -> None:
        last = self._last
        if last is not None and beat.step > last.step and last.phase not in _UNTIMED:
            self._intervals.append((beat.monotonic - last.monotonic) / (beat.step - last.step))
            self._timeout = None
        if last is None or beat.step != last.step or beat.phase != last.phase:
            if last is not None and beat.phase not in _UNTIMED:
                self._first_step = last.phase in (PHASE_STARTING, PHASE_RECOVERY) or (
                    self._first_step and beat.step == last.step)
            self._last = beat

    def step_timeout(self) -> float:
        """The timeout for a training step now; the startup timeout until one step is timed."""
        if self.fixed_timeout is not None:
            return self.fixed_timeout
        if not self._intervals:
            return self.startup_timeout
        if self._timeout is None:
            self._timeout = max(self.floor, self.factor * percentile(list(self._intervals), 0.99))
        return self._timeout

    def timeout(self) -> float | None:
        """The timeout of the phase the worker is in now; None: it has none (done, or in a
        phase the script declared long)."""
        beat = self._last
        if beat is None or beat.phase in (PHASE_DONE, PHASE_LONG):
            return None
        if beat.phase == PHASE_STARTING:
            return self.startup_timeout
        if beat.phase in (PHASE_CHECKPOINT, PHASE_RECOVERY):
            return self.checkpoint_timeout  # a recovery is bounded by the leader's watchdog
        if self._first_step and self.fixed_timeout is None:
            return FIRST_STEP_FACTOR * self.step_timeout()
        return self.step_timeout()

    def overdue(self, now: float) -> float | None:
        """The timeout the worker has exceeded at monotonic time `now`, or None."""
        timeout = self.timeout()
        if timeout is None:
            return None
        return timeout if now - self._last.monotonic > timeout else None

    def silent_for(self, now: float) -> float:
        """Seconds since the worker's current step (or phase) began."""
        return now - self._last.monotonic if self._last is not None else 0.0

    @property
    def timed_steps(self) -> int:
        """How many step intervals were observed (0 until the worker completes a step)."""
        return len(self._intervals)

    @property
    def last_beat(self) -> Beat | None:
        return self._last
