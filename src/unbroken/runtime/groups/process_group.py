"""Process groups a worker can form in a generation and abort from the inside.

Leaving a generation must unblock every peer still waiting on us in a collective. For gloo,
neither `destroy_process_group()` nor `ProcessGroup.abort()` closes the group's sockets while
anything still references the group (DDP does), so peers would wait for the full collective
timeout. We therefore note the connected sockets a group opens while it is formed and, to
abort, shut them down: each peer blocked on us fails at once with "connection closed". Only
connected sockets are shut down; gloo's listening socket must stay untouched (its accept loop
aborts the process otherwise). NCCL has a real abort, which we use.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store


def _socket_inodes() -> dict[int, str]:
    """fd -> 'socket:[inode]' for every socket this process holds."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


class AbortableGroups:
    """The process groups of one generation: formed together, aborted together."""

    def __init__(self) -> None:
        self._sockets: dict[int, str] = {}
        self.backend: str | None = None
        self._lock = threading.Lock()  # interrupt() may come from the watchdog thread

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Attribute to this generation the sockets opened inside the block."""
        before = _socket_inodes()
        try:
            yield
        finally:
            after = _socket_inodes()
            with self._lock:
                self._sockets.update({fd: ino for fd, ino in after.items()
                                      if before.get(fd) != ino})

    def form(self, store: Store, rank: int, world_size: int, backend: str,
             join_timeout: float, timeout: float) -> CheckpointGroups | None:
        """Make the default group from `store`, plus the gloo groups for checkpoints.

        Rendezvous is bounded by `join_timeout` (a member that died before joining must not
        block us for long); collectives then get the user's `timeout`.
        """
        self.backend = backend
        if not dist.is_initialized():
            # torch names each group by a process-wide counter, which `init_process_group`
            # advances before its rendezvous and only destroying a formed world resets: a
            # survivor whose earlier try timed out would name this world "1" where a fresh
            # replacement names it "0", and every later rendezvous would wait for keys the
            # other never writes. Every member starts each generation from 0.
            dist.distributed_c10d._world.group_count = 0
        with self.recording():
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=join_timeout),
                                    **bound_device(backend))
            dist.distributed_c10d._get_default_group().set_timeout(timedelta(seconds=timeout))
            if world_size == 1:
                return None
            return checkpoint_groups(join_timeout, timeout)

    def interrupt(self) -> None:
        """Make every collective on this generation's groups fail now, ours and our peers',
        without tearing the groups down (safe from another thread, while the main thread is
        blocked in one of them: see `runtime/generations/watchdog.py`). Idempotent."""
        with self._lock:
            if dist.is_initialized() and holds_nccl(dist.distributed_c10d._get_default_group()):
                _abort_nccl_groups()
            current = _socket_inodes()
            for fd, inode in self._sockets.items():
                if current.get(fd) != inode:
                    continue  # closed since, and the number perhaps reused: not ours any more
                try:
                    sock = socket.socket(fileno=fd)
                except OSError:
                    continue  # gloo closed it just now, after a peer's error
                try:
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # not connected (any more): nobody can be blocked on it
                finally:
                    sock.detach()  # the fd stays gloo's to close

    def abort(self) -> None:
        """Make every peer blocked on this generation's groups fail now; then tear them down."""
        self.interrupt()
        with self._lock:
            self._sockets.clear()
        self.destroy()

    def destroy(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):
                pass  # a broken group can fail to destroy cleanly; it is gone either way
        self.backend = None


_THIS_PROCESS = AbortableGroups()


def this_process() -> AbortableGroups:
    """The groups of this process's current generation, whoever formed them: the script
    (`script_group`), `unbroken.init()`, or the engine at a switch."""
    return _THIS_PROCESS


ABORT_BOUND = 10.0
"""Seconds `interrupt` waits for the NCCL groups' aborts, all running at once: an abort can
block for the collective timeout (a communicator's abort waiting on a kernel that never
ends, nccl-risks risk 6), and the watchdog thread that calls it must go on ticking the
heartbeat. An abort still running past it finishes in its thread."""


def _abort_nccl_groups() -> None:
    """Abort every process group's communicators, as `_abort_process_group()` does, but
    leave torch's registry of groups alone: the main thread, blocked in a collective, must
    fail with the communicator's error, not find the default group gone (a ValueError that
    would pass for the script's own). The main thread tears the groups down afterwards.
    Each group's abort runs in a thread of its own, together (not inside one NCCL group
    call, which groups nothing for aborts), and all of them are waited for at most
    `ABORT_BOUND` seconds in all."""
    c10d = dist.distributed_c10d
    groups = sorted(c10d._world.pg_names, key=lambda g: c10d._world.pg_names[g], reverse=True)

    def abort(group: Any) -> None:
        try:
            group.abort()
        except RuntimeError:
            pass  # already aborted (NCCL's own error handling got there first)

    threads = [threading.Thread(target=abort, args=(g,), name="unbroken-abort", daemon=True)
               for g in groups]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + ABORT_BOUND
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


@dataclass(frozen=True)
class CheckpointGroups:
    """Checkpoint traffic, never on the training group: `writes` carries DCP's collectives
    from the background writer, `control` the loop's decision to save (two threads must not
    share one group: their collectives would interleave differently on different ranks)."""

    writes: dist.ProcessGroup
    control: dist.ProcessGroup


def checkpoint_groups(form_timeout: float, timeout: float) -> CheckpointGroups:
    """Collective over the default group, like any new_group."""
    groups = []
    for _ in range(2):
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=form_timeout))
        group.set_timeout(timedelta(seconds=timeout))
        groups.append(group)
    return CheckpointGroups(*groups)


NCCL_CLASSES = frozenset({"ProcessGroupNCCL", "ProcessGroupNCCL2"})
"""The CUDA backends whose communicators `interrupt` aborts (torch 2.15's `nccl` is
ProcessGroupNCCL2 unless TORCH_DIST_USE_NCCL2=0: `control/nccl_env.py`)."""


def nccl_backed(backend: str | None, cuda: bool) -> bool:
    """`init_process_group(backend)` makes NCCL communicators: "nccl" (any form naming it:
    "nccl-legacy", "cpu:gloo,cuda:nccl"), or no backend at all (None, "", "undefined"),
    which torch makes "cpu:gloo,cuda:nccl" where a GPU is (`cuda`). Pure."""
    name = str(backend or "undefined")
    return "nccl" in name or (name in ("undefined", "None") and cuda)


def holds_nccl(group: Any) -> bool:
    """`group` has an NCCL backend for CUDA, whatever its name string said: decided by the
    backend's class (legacy or nccl2), so that `init_process_group()` with no backend and
    the mixed "cpu:gloo,cuda:nccl" are aborted like "nccl"."""
    return _nccl_backend(group) is not None


def _nccl_backend(group: Any) -> Any:
    """`group`'s CUDA backend if it is NCCL's (by class), else None."""
    try:
        backend = group._get_backend(torch.device("cuda"))
    except (RuntimeError, ValueError, AttributeError):
        return None  # no CUDA backend (gloo alone, or a CPU build of torch)
    return backend if type(backend).__name__ in NCCL_CLASSES else None


def drain_device(timeout: float) -> bool | None:
    """Wait, at most `timeout` seconds, for the work this process queued on its GPU
    (collectives included) to finish: a planned switch tears the old groups down only after
    it, so that no healthy collective in flight is aborted with partial data. True if it
    finished; False if the bound passed (a peer died in a collective: the abort that
    follows is a fault's); None where CUDA was never initialised (nothing to wait for)."""
    if not torch.cuda.is_initialized():
        return None
    done = threading.Event()

    def sync() -> None:
        torch.cuda.synchronize()
        done.set()

    threading.Thread(target=sync, name="unbroken-drain", daemon=True).start()
    return done.wait(timeout)


def nccl_errors() -> list[str]:
    """`name: ERROR` for each current group whose NCCL backend reports an error
    (`Backend.get_error()`: a timeout, a communicator error, a remote error, torch's own
    abort); empty without NCCL (`errors_of`)."""
    if not dist.is_initialized():
        return []
    c10d = dist.distributed_c10d
    backends = []
    for group, name in list(c10d._world.pg_names.items()):
        if (backend := _nccl_backend(group)) is not None:
            backends.append((name, backend))
    return errors_of(backends)


def bound_device(backend: str | None) -> dict:
    """`init_process_group`'s `device_id` where it makes NCCL communicators (`nccl_backed`):
    the communicator is bound to this worker's device at once (eager init), which `abort`
    needs to reach it. Called after `torch.cuda.set_device`. Nothing for gloo."""
    if not nccl_backed(backend, torch.cuda.is_available()):
        return {}
    return {"device_id": torch.device("cuda", torch.cuda.current_device())}


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def errors_of(backends: Iterable[tuple[str, Any]]) -> list[str]:
    """`name: ERROR` for each `(name, backend)` whose `get_error()` is not SUCCESS (a
    backend without `get_error`, an older torch's, reports nothing)."""
    out = []
    for name, backend in backends:
        get_error = getattr(backend, "get_error", None)
        if get_error is None:
            continue
        error = get_error()
        label = getattr(error, "name", str(error))
        if label != "SUCCESS":
            out.append(f"{name}: {label}")
    return out
