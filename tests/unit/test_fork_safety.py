"""The fork server refuses to fork where the child could inherit a broken process
(`runtime/fork_server.unsafe`): a thread it did not start with. The whole server, forking
real workers: tests/integration/test_fork_server.py."""

from __future__ import annotations

import threading

from unbroken.runtime.fork_server import _tasks, unsafe


def test_a_thread_the_server_did_not_start_with_refuses_the_fork():
    threads = _tasks()  # what it started with (a native library's pool counts as accounted)
    assert unsafe(threads) is None
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait, name="a preimport's thread", daemon=True)
    extra.start()
    try:
        why = unsafe(threads)
    finally:
        stop.set()
        extra.join()
    assert why is not None and "a preimport's thread" in why and "\n" not in why


def test_a_worker_whose_load_time_variables_differ_from_the_servers_starts_cold():
    from unbroken.control.fork_requests import load_time_differences

    server = {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/a", "HOME": "/root", "RANK": ""}
    same = {**server, "RANK": "3", "HOME": "/elsewhere", "PYTORCH_NVML_BASED_CUDA_CHECK": "0"}
    assert load_time_differences(server, same) == []  # neither read at load: forked
    worker = {**server, "OMP_NUM_THREADS": "4", "KMP_AFFINITY": "compact"}
    del worker["PYTHONPATH"]
    assert load_time_differences(server, worker) == ["KMP_AFFINITY", "OMP_NUM_THREADS",
                                                     "PYTHONPATH"]
