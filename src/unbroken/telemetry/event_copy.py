"""A node's events kept where they outlive its pod: a file of its own on a shared volume
(`--event-dir`), or the container's stdout as tagged JSON lines (`--event-stdout`).

On Kubernetes a pod's run dir is an emptyDir, gone with the pod: its events, and with them
`unbroken report` and `simulate --from-run` of a job after it ends. So each agent copies
its node's events (`node_log.NodeLog`: the agent's own and its workers') as they come:

- into `DIR/node<K>-<ID>.jsonl`, `ID` the pod's UID (`UNBROKEN_POD_UID`, the downward
  API's `metadata.uid`) or else the agent's instance id: one writer per file, never a file
  another pod may hold (appends from two clients are not atomic on NFS or EFS); a recreated
  pod writes a new file beside its predecessor's;
- or to stdout, each line `EVENT_TAG` + the record's JSON, which `kubectl logs` keeps as
  long as the cluster keeps pod logs, and `unbroken report` reads from a saved log.

`unbroken report DIR` merges every file in DIR, a deleted pod's included (`report`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from unbroken.telemetry.live import SayOnce
from unbroken.telemetry.node_log import NodeLog

EVENT_TAG = "unbroken-event: "
"""What starts an event's line on stdout (`--event-stdout`); the rest is its JSON."""
POD_UID_ENV = "UNBROKEN_POD_UID"
"""The pod's UID (`unbroken k8s` sets it from the downward API): names the node's file."""


COPY_GLOB = "node*-*.jsonl"
"""The nodes' copies in an event dir (`copy_name`)."""


def copy_name(node: int, ident: str) -> str:
    """The file a node's agent copies its events to, in the event dir. Pure."""
    return f"node{node}-{ident}.jsonl"


class EventCopy:
    """The agent's thread that copies its node's events every `poll_s`; `close()` copies
    what is left (the agent's exit included) and stops."""

    def __init__(self, log: NodeLog, say: Callable[[str], None], *, event_dir: Path | None,
                 ident: str, stdout: TextIO | None = None, poll_s: float = 0.5) -> None:
        """`event_dir`: the shared dir (None: no file). `stdout`: where tagged lines go
        (None: nowhere)."""
        self._log, self._dir, self._ident, self._stdout = log, event_dir, ident, stdout
        self._fd: int | None = None
        self._failed = SayOnce(say, "events", "the copy of this node's events is incomplete")
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="unbroken-event-copy",
                                        daemon=True)
        self._thread.start()

    @property
    def path(self) -> Path | None:
        """The node's file, once its node is known (None without an event dir)."""
        node = self._log.node()
        if self._dir is None or node is None:
            return None
        return self._dir / copy_name(node, self._ident)

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.copy()

    def copy(self) -> None:
        with self._lock:
            try:
                records = [record for _own, record in self._log.read()]
                if records:
                    self._write(records)
            except Exception as exc:  # noqa: BLE001 -- the copy never stops the job
                self._failed(exc)

    def _write(self, records: list[dict[str, Any]]) -> None:
        lines = "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n"
                        for r in records)
        if self._stdout is not None:  # a line per write: whole between the workers' lines
            for line in lines.splitlines(True):
                self._stdout.write(EVENT_TAG + line)
                self._stdout.flush()
        if self._dir is not None:
            if self._fd is None:
                self._dir.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            data = lines.encode()
            while data:
                data = data[os.write(self._fd, data):]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.copy()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        self._log.close()

