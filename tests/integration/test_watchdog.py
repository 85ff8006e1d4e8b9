"""The worker's watchdog thread against a real heartbeat page: it ticks, and it aborts a
generation only when the leader's switch is due and the main thread is inside a step of an
older generation, once. (The real abort of real groups: tests/integration/test_failover.py, test_hang.py.)"""

from __future__ import annotations

import time

from conftest import wait_for

from unbroken.launch.workers.heartbeat_reader import HeartbeatReader
from unbroken.runtime.generations.watchdog import Watchdog
from unbroken.runtime.heartbeat import LEAVE_NOW, HeartbeatWriter


def _watchdog(tmp_path):
    writer = HeartbeatWriter(tmp_path / "hb")
    reader = HeartbeatReader(tmp_path / "hb")
    interrupted, recorded = [], []
    dog = Watchdog(writer, lambda: interrupted.append(time.monotonic()),
                   lambda *a: recorded.append(a), period=0.005)
    assert not dog.errors
    return writer, reader, dog, interrupted, recorded


def test_it_ticks_so_that_the_agent_sees_the_process_run(tmp_path):
    writer, reader, dog, _, _ = _watchdog(tmp_path)
    assert reader.read().alive is None  # no watchdog yet
    dog.start()
    try:
        first = reader.read().alive
        wait_for(lambda: reader.read().alive > first, 5, "a second tick")
    finally:
        dog.stop()


def test_it_aborts_a_step_of_a_broken_generation_once(tmp_path):
    writer, reader, dog, interrupted, recorded = _watchdog(tmp_path)
    writer.stamp(10)
    dog.start()
    try:
        dog.entered(gen=0, step=10)
        reader.set_target(1, LEAVE_NOW)  # the leader broke generation 0: leave at once
        wait_for(lambda: interrupted, 5, "the abort")
        time.sleep(0.05)
        assert len(interrupted) == 1 and recorded == [(0, 1, 10)]
    finally:
        dog.stop()


def test_it_leaves_a_planned_switch_and_a_step_boundary_alone(tmp_path):
    writer, reader, dog, interrupted, _ = _watchdog(tmp_path)
    dog.start()
    try:
        dog.entered(gen=0, step=10)
        reader.set_target(1, 12)  # a grow-back at step 12: made at that boundary
        time.sleep(0.1)
        dog.entered(gen=0, step=13)  # even past it (a fast rank on another node)
        time.sleep(0.1)
        dog.left()  # between steps: the main thread will see the switch itself
        reader.set_target(1, LEAVE_NOW)
        time.sleep(0.1)
        dog.entered(gen=1, step=11)  # already in the target generation
        time.sleep(0.1)
        assert interrupted == []
    finally:
        dog.stop()
