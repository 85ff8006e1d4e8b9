"""The local path of a departure: a worker's post reaches its agent's relay as data; what is
not a departure is counted and dropped; a post with no agent listening says so at once."""

from __future__ import annotations

import os
import socket
import stat

from unbroken.control import departure_post
from unbroken.control.messages import Departure, LeaveReason
from unbroken.launch.workers.departure_relay import DepartureRelay


def _left(wid: str) -> Departure:
    return Departure(wid=wid, gen=2, step=7, holds_state=True, reason=LeaveReason.PEER, t=1.0,
                     error="peer died")


def test_posts_reach_the_relay_and_garbage_is_dropped(tmp_path) -> None:
    relay = DepartureRelay.open()
    assert relay is not None and relay.path is not None
    try:
        assert stat.S_IMODE(os.stat(os.path.dirname(relay.path)).st_mode) == 0o700
        assert departure_post.post(relay.path, 3, _left("0.0"))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b'{"attempt": "__import__(\'os\')"}', relay.path)
        assert departure_post.post(relay.path, 3, _left("1.0"))
        assert relay.receive(now=5.0) == 2
        assert relay.rejected == 1
        [batch] = relay.gather.take(lambda gen: {"0.0", "1.0"}, now=5.0)
        assert (batch.attempt, batch.gen, batch.wids) == (3, 2, ["0.0", "1.0"])
        assert batch.departures[0] == _left("0.0")
        assert relay.receive(now=6.0) == 0  # drained: nothing waits, nothing blocks
    finally:
        relay.close()
    assert not os.path.exists(relay.path)
    # No agent listening (it is gone): the worker is told at once and writes its own.
    assert not departure_post.post(relay.path, 3, _left("2.0"))
    too_long = Departure(wid="3.0", gen=2, step=7, holds_state=True,
                         reason=LeaveReason.EXCEPTION, t=1.0, traceback="x" * 70_000)
    assert not departure_post.post(str(tmp_path / "nobody"), 3, too_long)
