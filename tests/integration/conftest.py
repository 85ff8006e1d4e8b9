"""The integration tier: real agents, workers, faults, services and network namespaces.

Every test here checks afterwards that no process of its run is still alive (an agent, a
worker, or a worker's child); the helpers that launch them are in tests/conftest.py.
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import alive, processes_mentioning, wait_for


@pytest.fixture(autouse=True)
def no_process_outlives_its_test(tmp_path):
    yield
    marker = str(tmp_path)
    try:
        wait_for(lambda: not [p for p in processes_mentioning(marker) if alive(p)], 10,
                 "the test's processes to exit")
    except AssertionError:
        leaked = [p for p in processes_mentioning(marker) if alive(p)]
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise AssertionError(f"processes outlived the test: {leaked}") from None
