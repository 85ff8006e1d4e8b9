"""The integration tier: real agents, workers, faults, services and network namespaces.

Every test here checks afterwards that no process of its run is still alive (an agent, a
worker, or a worker's child); the helpers that launch them are in tests/conftest.py.
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import alive, processes_mentioning, wait_for

# The longest modules first: `make test` hands modules to its two workers in collection order
# (`--dist loadfile`), and a long module handed out last runs alone at the end while the
# other worker idles (longest-processing-time-first scheduling). Each module's seconds in a
# clean-clone run on this 2-core machine (75480eb), summed over its tests (`--durations`,
# those under 28 s estimated from their count); a module not listed keeps its alphabetical
# place after these.
HEAVY_FIRST = {
    "test_torchrun_compat.py": 900, "test_share_nothing.py": 400, "test_hf_trainer.py": 360,
    "test_failover.py": 250, "test_pods.py": 240, "test_lightning.py": 235,
    "test_in_place.py": 200, "test_gpu_multi_dry_run.py": 190, "test_async_checkpoint.py": 180,
    "test_hf_deepspeed.py": 180, "test_own_loop.py": 165, "test_sharded.py": 115,
    "test_gpu_check_dry_run.py": 105, "test_trl.py": 90,
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -HEAVY_FIRST.get(item.path.name, 0))  # stable: else as found


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
