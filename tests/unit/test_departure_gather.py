"""A node's departures of a generation go out in one write once every member here left, or
when the window closes (`launch/workers/departure_relay.py`, pure part)."""

from __future__ import annotations

from unbroken.control import departure_post
from unbroken.control.messages import Departure, LeaveReason
from unbroken.launch.workers.departure_relay import DepartureGather


def left(wid: str, gen: int = 0) -> Departure:
    return Departure(wid=wid, gen=gen, step=5, holds_state=True, reason=LeaveReason.PEER, t=0.0)


def test_a_generation_goes_out_in_one_batch_once_every_member_here_left() -> None:
    g = DepartureGather(window=0.05)
    here = {"0.0", "1.0", "2.0"}
    g.offer(0, left("0.0"), now=10.0)
    g.offer(0, left("1.0"), now=10.001)
    assert g.take(lambda gen: here, now=10.002) == []  # 2.0 is still in generation 0
    assert abs(g.due_in(10.002) - 0.048) < 1e-9
    g.offer(0, left("2.0"), now=10.003)
    [batch] = g.take(lambda gen: here, now=10.003)
    assert (batch.attempt, batch.gen, batch.wids, batch.since) == (0, 0, ["0.0", "1.0", "2.0"], 10.0)
    assert g.due_in(10.003) is None and g.take(lambda gen: here, now=11.0) == []


def test_a_member_that_never_leaves_holds_the_others_only_for_the_window() -> None:
    g = DepartureGather(window=0.05)
    here = {"0.0", "1.0"}  # 1.0 is stopped: it will be killed, then it is dead
    g.offer(0, left("0.0"), now=10.0)
    assert g.take(lambda gen: here, now=10.049) == []
    [batch] = g.take(lambda gen: here, now=10.05)
    assert batch.wids == ["0.0"]
    g.offer(0, left("1.0"), now=10.2)  # it left after all: a batch of its own, at once
    [late] = g.take(lambda gen: here, now=10.2)
    assert late.wids == ["1.0"]


def test_a_member_that_died_is_not_waited_for() -> None:
    g = DepartureGather(window=0.05)
    g.offer(0, left("0.0"), now=10.0)
    [batch] = g.take(lambda gen: {"0.0"}, now=10.0)  # 1.0 died: its agent publishes that
    assert batch.wids == ["0.0"]


def test_generations_and_attempts_are_batched_apart_and_twice_is_once() -> None:
    g = DepartureGather(window=0.05)
    g.offer(0, left("0.0", gen=1), now=1.0)
    g.offer(0, left("0.0", gen=1), now=1.0)  # posted twice
    g.offer(0, left("1.0", gen=2), now=1.0)  # superseded: left a generation that never formed
    g.offer(1, left("0.0", gen=0), now=1.0)
    batches = g.take(lambda gen: {"0.0"} if gen == 1 else set(), now=1.0)
    assert sorted((b.attempt, b.gen, tuple(b.wids)) for b in batches) == [
        (0, 1, ("0.0",)), (0, 2, ("1.0",)), (1, 0, ("0.0",))]


def test_a_posted_departure_travels_as_data_and_garbage_is_refused() -> None:
    d = left("3.1", gen=4)
    posted = departure_post.decode(departure_post.encode(7, d))
    assert posted is not None and posted.attempt == 7 and posted.departure == d
    for garbage in (b"", b"not json", b"[1, 2]", b'{"attempt": 1}', b"\xff\xfe"):
        assert departure_post.decode(garbage) is None
