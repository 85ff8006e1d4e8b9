"""Polling until something is ready, within a deadline: the one loop every waiter uses.

A waiter says what it waits for as a function that returns None until the thing is there
(`ready`), for how long, and how often to look. `poll_until` owns the deadline, the pauses,
and what happens when time is up (`timeout_error`, by default `PollTimeout`). A waiter that
gives up quietly catches `PollTimeout`.

The clock and the sleep are looked up when `poll_until` is called, unless given: tests pass
their own, and need no real time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class PollTimeout(TimeoutError):
    """What was polled for was not ready within the timeout."""

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(f"{what} not ready within {timeout:g}s")
        self.what = what
        self.timeout = timeout


@dataclass(frozen=True)
class Backoff:
    """Pauses that grow: `first` seconds, then each pause `factor` times the last, up to `cap`."""

    first: float  # the first pause, in seconds
    factor: float = 2.0  # each pause is the last one times this
    cap: float = 1.0  # no pause is longer than this, in seconds

    def pauses(self) -> Callable[[], float]:
        """A function that returns the next pause each time it is called."""
        pause = self.first

        def next_pause() -> float:
            nonlocal pause
            now, pause = pause, min(self.cap, pause * self.factor)
            return now

        return next_pause


def poll_until(
    ready: Callable[[], T | None],
    timeout: float,
    interval: float | Backoff,
    *,
    what: str = "the wait",
    timeout_error: Callable[[], BaseException] | None = None,
    on_wait: Callable[[float], None] | None = None,
    sleep: Callable[[float], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> T:
    """Call `ready()` until it returns something other than None, and return that.

    `ready` is called at once, then after each pause (`interval` seconds, or a `Backoff`'s
    growing pauses). Each time it returns None:
    - once more than `timeout` seconds have passed since the call, `timeout_error()` is
      raised (`PollTimeout(what, timeout)` without one);
    - otherwise `on_wait(waited)`, with the seconds waited so far, then the pause.
    Whatever `ready` or `on_wait` raise goes through. `sleep` and `clock` default to
    `time.sleep` and `time.monotonic`."""
    sleep = sleep if sleep is not None else time.sleep
    clock = clock if clock is not None else time.monotonic
    pause = interval.pauses() if isinstance(interval, Backoff) else (lambda: interval)
    start = clock()
    deadline = start + timeout
    while (result := ready()) is None:
        now = clock()
        if now > deadline:
            raise timeout_error() if timeout_error is not None else PollTimeout(what, timeout)
        if on_wait is not None:
            on_wait(now - start)
        sleep(pause())
    return result
