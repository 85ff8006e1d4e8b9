"""The one polling helper (`unbroken.polling`), on a fake clock: no real time passes."""

from __future__ import annotations

import pytest

from unbroken.polling import Backoff, PollTimeout, poll_until


class FakeTime:
    """A clock that moves only when slept on; records each pause."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_returns_what_ready_gives_and_pauses_between_looks():
    t = FakeTime()
    answers = iter([None, None, "there"])
    assert poll_until(lambda: next(answers), 10.0, 0.5, sleep=t.sleep, clock=t.clock) == "there"
    assert t.pauses == [0.5, 0.5]


def test_ready_at_once_never_pauses():
    t = FakeTime()
    assert poll_until(lambda: 0, 0.0, 1.0, sleep=t.sleep, clock=t.clock) == 0  # 0 is an answer
    assert t.pauses == []


def test_time_up_raises_poll_timeout_after_one_last_look():
    t = FakeTime()
    looks = []

    def never():
        looks.append(t.now)
        return None

    with pytest.raises(PollTimeout, match="the plan not ready within 1s") as raised:
        poll_until(never, 1.0, 0.25, what="the plan", sleep=t.sleep, clock=t.clock)
    assert raised.value.timeout == 1.0 and isinstance(raised.value, TimeoutError)
    # Looks at 0, .25, .5, .75, 1.0 (not yet past), 1.25 (past): then it gives up.
    assert [round(x - 100.0, 2) for x in looks] == [0, 0.25, 0.5, 0.75, 1.0, 1.25]


def test_the_waiters_own_error_is_raised():
    t = FakeTime()
    with pytest.raises(KeyError, match="gone"):
        poll_until(lambda: None, 0.1, 0.1, timeout_error=lambda: KeyError("gone"),
                   sleep=t.sleep, clock=t.clock)


def test_on_wait_hears_the_seconds_waited_before_each_pause():
    t = FakeTime()
    heard = []
    answers = iter([None, None, None, True])
    poll_until(lambda: next(answers), 5.0, 1.0, on_wait=heard.append, sleep=t.sleep,
               clock=t.clock)
    assert heard == [0.0, 1.0, 2.0]


def test_errors_from_ready_go_through():
    t = FakeTime()

    def broken():
        raise ValueError("wrong secret")

    with pytest.raises(ValueError, match="wrong secret"):
        poll_until(broken, 5.0, 1.0, sleep=t.sleep, clock=t.clock)


def test_backoff_grows_each_pause_up_to_its_cap():
    t = FakeTime()
    with pytest.raises(PollTimeout):
        poll_until(lambda: None, 0.2, Backoff(0.001, 2.0, 0.05), sleep=t.sleep, clock=t.clock)
    assert t.pauses[:7] == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05]
    assert set(t.pauses[7:]) == {0.05}


def test_real_sleep_is_looked_up_at_the_call():
    """Without a `sleep`, `time.sleep` of the moment is used (here: the unit tier's guard)."""
    with pytest.raises(BaseException, match="must not sleep"):  # the guard is no Exception
        poll_until(lambda: None, 60.0, 1.0)
