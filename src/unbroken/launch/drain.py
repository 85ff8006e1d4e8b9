"""`unbroken drain`: move a rank or a whole node of a running job onto ready spares.

The command is a client of the job's control store. It files a drain request and waits for
the leader's answer: the leader has a ready spare promoted into each drained slot, and once
the spare has registered (its warm-up and connection overlap with training), every member
switches at a step boundary to a generation that names the spare instead. The drained
worker exits cleanly; a drained node's agent leaves the job.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from unbroken.errors import ControlPlaneError, UserError
from unbroken.launch.control_store import ControlStore, connect_store

CONTROL_FILE = "control.json"  # in the run dir: where the leader's store is, and the run id


def find_store(run_dir: str | None, addr: str | None, port: int | None,
               run_id: str | None) -> tuple[str, int, str]:
    """The job's store address and run id, from flags or from the leader's control file."""
    if run_dir is not None:
        path = Path(run_dir) / CONTROL_FILE
        try:
            control = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path} not found: is {run_dir} the --run-dir of a running job? "
                            "(or give --master-addr, --master-port and --rdzv-id)") from None
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        return (addr or control["addr"], port or int(control["port"]), run_id or control["run_id"])
    if port is None or run_id is None:
        raise UserError("give the job's --run-dir, or its --master-port and --rdzv-id")
    return addr or "127.0.0.1", port, run_id


def request_drain(ctl: ControlStore, target: dict[str, int], timeout: float) -> dict[str, Any]:
    """File a drain request with the leader and wait for its outcome."""
    if ctl.get_json("result"):
        raise UserError("the job has already ended")
    attempt = ctl.get_json("current")
    if attempt is None or ctl.get_json(f"a/{attempt}/plan") is None:
        raise UserError("the job has not started training yet; try again once it has")
    index = ctl.add(f"a/{attempt}/drains", 1) - 1
    ctl.set_json(f"a/{attempt}/drain/{index}", target)
    ctl.add(f"a/{attempt}/news", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outcome = ctl.get_json(f"a/{attempt}/drain/{index}/outcome")
        if outcome is not None:
            return outcome
        if ctl.get_json("current") != attempt or ctl.get_json("result"):
            raise UserError("the job restarted or ended before the drain completed")
        time.sleep(0.05)
    raise UserError(f"the drain did not complete within {timeout:g}s; see the job's events "
                    "(drain_started, spare_promoted)")


def drain(run_dir: str | None, addr: str | None, port: int | None, run_id: str | None,
          rank: int | None, node: int | None, timeout: float) -> dict[str, Any]:
    if (rank is None) == (node is None):
        raise UserError("give exactly one of --rank R or --node K")
    if (rank if rank is not None else node) < 0:
        raise UserError("--rank and --node must be 0 or more")
    host, port, run_id = find_store(run_dir, addr, port, run_id)
    try:  # a fast, quiet answer when nothing listens (the store client retries, and logs)
        socket.create_connection((host, port), timeout=5.0).close()
    except OSError as exc:
        raise ControlPlaneError(f"cannot reach the job's control store at {host}:{port} "
                                f"({exc.strerror or exc}); is the job running?") from None
    ctl = ControlStore(connect_store(host, port, timeout=5.0), run_id)
    try:
        outcome = request_drain(ctl, {"slot": rank} if rank is not None else {"node": node}, timeout)
    except (RuntimeError, OSError) as exc:  # what a store call raises when the server is gone
        raise ControlPlaneError(f"lost the job's control store at {host}:{port} (the job ended?): "
                                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if not outcome.get("ok"):
        raise UserError(f"drain refused: {outcome.get('error')}")
    return outcome
