"""The flight recorder's switches, where its dumps go, and one dump per generation's end
(`runtime/generations/flight_recorder.py`, `Watchdog.dump`). The dumps of real hangs:
tests/integration/test_hang.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.runtime.generations.flight_recorder import FlightRecorder, enabled
from unbroken.runtime.generations.watchdog import Watchdog


@pytest.mark.parametrize(("environ", "on"), [
    ({}, False),
    ({"TORCH_FR_BUFFER_SIZE": "0"}, False),
    ({"TORCH_FR_BUFFER_SIZE": "2000"}, True),
    ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, True),
    # torch reads TORCH_FR_BUFFER_SIZE first: a 0 there turns the recorder off
    ({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, False),
    ({"TORCH_FR_BUFFER_SIZE": "lots"}, False),
])
def test_the_recorder_is_on_as_torch_reads_its_buffer_size(environ, on):
    assert enabled(environ) is on


def test_a_dump_goes_to_the_users_prefix_or_the_node_dir():
    node = FlightRecorder("/runs/job/node_1", lambda: 5, lambda event: None, environ={})
    assert node.path() == Path("/runs/job/node_1/flight_recorder/rank_5")
    theirs = FlightRecorder("/runs/job/node_1", lambda: 5, lambda event: None,
                            environ={"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"})
    assert theirs.path() == Path("/scratch/fr_5")
    assert FlightRecorder(None, lambda: 5, lambda event: None, environ={}).path() is None


def test_a_recorder_that_is_off_writes_nothing_and_says_nothing():
    said = []
    off = FlightRecorder("/nonexistent/node_0", lambda: 0, said.append, environ={})
    assert off.dump("abort") is None and said == []


def test_each_generations_end_is_dumped_once_by_whoever_sees_it_first():
    dumps = []
    dog = Watchdog(heartbeat=None, interrupt=lambda: None, on_abort=lambda *a: None,
                   dump=dumps.append)
    dog.dump("abort", 3)  # the watchdog's abort of generation 3
    dog.dump("peer", 3)  # the main thread then leaves it on the aborted collective's error
    dog.dump("peer", 4)
    dog.dump("abort", 2)  # an older generation's: already over
    assert dumps == ["abort", "peer"]
