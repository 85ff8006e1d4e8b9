"""Ending a process that has loaded torch, without torch's C++ teardown.

Python-level shutdown still happens: non-daemon threads are joined, atexit handlers run,
output is flushed. What is skipped is the destruction of torch's C++ statics, which took
0.5-2.5 s per worker here and sometimes aborted (SIGABRT, "terminate called without an
active exception": a TCPStore or gloo thread still joinable), turning a success into a
fault, or an agent's clean exit code into -6.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or broken pipe: nothing left to flush to
    os._exit(code)
