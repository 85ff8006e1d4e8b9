"""The integration tier: real agents, workers, faults, services and network namespaces.

Every test here checks afterwards that no process of its run is still alive (an agent, a
worker, or a worker's child); the helpers that launch them are in tests/conftest.py.
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import alive, processes_mentioning, wait_for


@pytest.fixture(autouse=True, scope="session")
def no_warm_pool():
    """Agents here keep no warm interpreters (`--no-warm-restarts`, by its `PET_` variable,
    which every agent the tests start inherits), except in the tests about them (the
    `warm_pool` fixture). On these 2 cores a pool's imports take the CPU the workers need:
    a 4-worker in-place test took 19.7 s with it and 15.7 s without, although its
    replacement then starts cold. On a GPU host, whose CPUs are mostly idle, the pool is
    what makes a restart fast, and it stays on by default."""
    os.environ["PET_WARM_RESTARTS"] = "1"  # an off switch's variable: true means the flag
    yield
    os.environ.pop("PET_WARM_RESTARTS", None)


@pytest.fixture
def warm_pool(monkeypatch):
    """For a test about the warm interpreters: agents keep them, as by default."""
    monkeypatch.delenv("PET_WARM_RESTARTS", raising=False)


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
