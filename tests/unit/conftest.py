"""The unit tier: no processes, no sockets, no sleeps; the whole tier runs in seconds.

The tier's contract is enforced, not hoped for: while a unit test runs, starting a process,
opening a socket (Python's or a TCPStore), forming a process group or sleeping raises
`NotInUnitTier`, and an exception in any thread the test started fails the test. A test
that needs one of these belongs in tests/integration.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
import torch.distributed as dist

# matplotlib builds its font cache on its first import in a fresh environment by running
# `fc-list`: done here, at collection, before any test's guard is up.
try:
    import matplotlib.font_manager  # noqa: F401
except ImportError:
    pass


class NotInUnitTier(BaseException):
    """Raised by what a unit test must not do. A BaseException, so that the code under test
    cannot catch it as an ordinary error and go on."""


def _forbidden(what: str):
    def refuse(*args, **kwargs):
        raise NotInUnitTier(f"a unit test must not {what}: move it to tests/integration")
    return refuse


FORBIDDEN = [
    (subprocess.Popen, "__init__", "start a process"),
    (os, "fork", "fork"),
    (os, "posix_spawn", "start a process"),
    (socket.socket, "__init__", "open a socket"),
    (time, "sleep", "sleep"),
    (dist, "TCPStore", "open a TCPStore"),
    (dist, "init_process_group", "form a process group"),
]


@pytest.fixture(autouse=True)
def only_what_a_unit_test_may_do(monkeypatch):
    for owner, name, what in FORBIDDEN:
        monkeypatch.setattr(owner, name, _forbidden(what))
    yield


def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.filterwarnings(
                "error::pytest.PytestUnhandledThreadExceptionWarning"))
