"""torch's flight recorder, dumped before a hang's evidence is destroyed.

torch records each process group's recent collectives (the flight recorder) when the user
turns it on (`TORCH_FR_BUFFER_SIZE`, or `TORCH_NCCL_TRACE_BUFFER_SIZE`, > 0). Its dump is
what `torch.distributed.flight_recorder`'s analyser (`fr_trace`) reads to say which rank
never entered which collective. torch writes one on its own watchdog's timeout, which an
in-place job turns off (`TORCH_NCCL_DUMP_ON_TIMEOUT=0`, docs/design-notes.md): our hang
path blames and kills before torch's timeout. So the worker's watchdog thread dumps instead,
at the moments that destroy the evidence:
- before it aborts its generation on the leader's notice (a peer died or hung: NCCL's
  kernels wait on), or before the worker leaves it on a peer's error (gloo's sockets fail
  at once), whichever comes first (once a generation): this rank's view of the collective
  it was blocked in;
- when its agent asks, before the agent kills a rank the leader blamed for a hang
  (`launch/workers/hang_watch.py`): the culprit's own view, if any thread of it still runs.

Each dump goes where torch would put it, `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` + the rank (the
user's prefix), or else `<node dir>/flight_recorder/rank_<rank>` (a later dump of the same
rank replaces it), written whole (a temporary file, then a rename), and is an event
(`flight_recorder_dumped`). A flight recorder that is off dumps nothing and costs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from unbroken.telemetry import schema as ev

BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch's switches of the flight recorder, the first set wins (torch reads them in this
order)."""
PREFIX_VARIABLE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def enabled(environ: Mapping[str, str]) -> bool:
    """The flight recorder records: its buffer size, as torch reads it, is above 0."""
    for name in BUFFER_VARIABLES:
        if name in environ:
            try:
                return int(environ[name]) > 0
            except ValueError:
                return False
    return False


def trace() -> bytes:
    """The flight recorder's dump, pickled as torch's analyser reads it: the NCCL recorder's
    where this torch has one (CUDA builds), otherwise the generic one (gloo included)."""
    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_nccl_trace", None) or c10d._dump_fr_trace
    return dump()


class FlightRecorder:
    """Dumps this worker's flight recorder (see the module docstring). Called from the
    watchdog thread, never from the main thread, which may be the one blocked."""

    def __init__(self, node_dir: str | os.PathLike[str] | None, rank: Callable[[], int],
                 record: Callable[..., object],
                 environ: Mapping[str, str] = os.environ) -> None:
        self._node_dir = node_dir
        self._rank = rank
        self._record = record
        self._environ = environ

    def path(self) -> Path | None:
        """Where this rank's dump goes; None with no prefix and no node dir."""
        prefix = self._environ.get(PREFIX_VARIABLE)
        if prefix:
            return Path(f"{prefix}{self._rank()}")
        if self._node_dir is None:
            return None
        return Path(self._node_dir) / "flight_recorder" / f"rank_{self._rank()}"

    def dump(self, reason: str) -> Path | None:
        """Write the dump if the recorder is on (checked now: a script may turn it on in
        `os.environ` before it forms its group); the path written, or None."""
        if not enabled(self._environ):
            return None
        path = self.path()
        if path is None:
            return None
        data = trace()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        os.replace(partial, path)
        self._record(ev.FlightRecorderDumped(path=str(path), bytes=len(data), reason=reason))
        return path
