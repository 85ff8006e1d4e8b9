"""The unit tier's guard refuses what a unit test must not do (tests/unit/conftest.py)."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
import torch.distributed as dist

from unit.conftest import NotInUnitTier


@pytest.mark.parametrize("act", [
    lambda: subprocess.run(["true"]),
    lambda: socket.socket(),
    lambda: time.sleep(0),
    lambda: dist.TCPStore("127.0.0.1", 0, 1, True),
], ids=["process", "socket", "sleep", "tcpstore"])
def test_what_a_unit_test_must_not_do_raises(act):
    with pytest.raises(NotInUnitTier, match="move it to tests/integration"):
        act()
