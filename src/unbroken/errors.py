"""Errors a user can fix, and the exit codes that tell a caller what happened."""

from __future__ import annotations

import re
from enum import IntEnum, StrEnum


class ExitCode(IntEnum):
    """Exit codes of `unbroken run`: what ended this node's agent, and what a scheduler
    should do about it (`RETRY`). Declared once: the table in docs/troubleshoot.md and the
    Kubernetes failure policies follow this enum (tests/unit/test_exit_codes.py checks the
    table)."""

    SUCCESS = 0
    """Every rank trained to the end."""
    GAVE_UP = 1
    """A fault the job could not recover from: the restart budget was spent. Permanent."""
    USAGE = 2
    """Bad usage or configuration: a bad flag or value, a missing script, a secret that
    differs from the job's, a job id or etcd credentials that cannot be used. Permanent:
    never worth a retry."""
    CONTROL_PLANE = 3
    """The control plane was lost (or never formed: nodes did not join in time), or this
    node was declared lost while cut off. Transient: restarting this node's agent is worth
    it."""
    QUARANTINED = 4
    """This node was quarantined after repeated faults; the job goes on without it. Never
    counts as the job done; do not restart it on the same machine."""
    DRAINED = 5
    """This node left on a drain (`unbroken drain --node`): every rank moved to spares and
    the job goes on without it. Not the job done (only 0 is): a scheduler may bring it back,
    and it rejoins as a standby node."""
    INTERRUPTED_SIGINT = 130
    """Stopped by SIGINT (128 + 2); its workers were stopped first."""
    INTERRUPTED_SIGTERM = 143
    """Stopped by SIGTERM (128 + 15): a pod deletion, an eviction, a spot reclaim. Its ranks
    moved to spares or standby nodes first when any were ready."""


class Retry(StrEnum):
    """What a scheduler should do with a node whose agent exited with a code."""

    NONE = "none"  # the job is done
    NEVER = "never"  # permanent: fail the job
    NODE = "node"  # transient: restart this node (its agent rejoins)
    REPLACE = "replace"  # this machine is bad: bring the node back elsewhere, or not at all
    SIGNAL = "signal"  # it was told to stop or leave: as the scheduler (or operator) meant


RETRY = {
    ExitCode.SUCCESS: Retry.NONE,
    ExitCode.GAVE_UP: Retry.NEVER,
    ExitCode.USAGE: Retry.NEVER,
    ExitCode.CONTROL_PLANE: Retry.NODE,
    ExitCode.QUARANTINED: Retry.REPLACE,
    ExitCode.DRAINED: Retry.SIGNAL,
    ExitCode.INTERRUPTED_SIGINT: Retry.SIGNAL,
    ExitCode.INTERRUPTED_SIGTERM: Retry.SIGNAL,
}


# What a worker's error says when a peer died or left, not its own code: gloo's connection
# errors, NCCL's, torch's distributed errors. The agent blames such errors on the peer; the
# worker runtime recovers from them in place.
PEER_ERROR_MARKERS = ("gloo", "Connection closed", "Connection reset", "Broken pipe", "NCCL",
                      "DistNetworkError", "DistBackendError", "DistStoreError")

# What says the worker's own device failed: the CUDA context is broken (sticky errors), so
# the process must go, and a fresh one take its rank. Out of memory is not among them: the
# context survives it, and it is the script's to handle (a user error).
OWN_DEVICE_MARKERS = ("CUDA error", "CUDA driver error", "device-side assert",
                      "CUBLAS_STATUS_", "CUDNN_STATUS_", "cuDNN error", "unhandled cuda error",
                      "ncclUnhandledCudaError")
# NCCL errors that are the caller's mistake, whichever rank hits them.
USER_NCCL_MARKERS = ("ncclInvalidUsage", "ncclInvalidArgument", "invalid usage", "invalid argument")


class ErrorClass(StrEnum):
    """Whose fault an exception in a worker is (`classify`)."""

    PEER = "peer"
    """The group broke under it (a peer died, hung or left): the worker survives."""
    OWN_DEVICE = "own_device"
    """Its own accelerator failed: the worker dies and a fresh process takes its rank."""
    USER = "user"
    """The script's own error (a bug, a bad batch, out of memory)."""
    STOP = "stop"
    """The worker decided the job must end (`JobStopped`: too many numerical anomalies):
    no restart helps, and no node is to blame. The job ends with exit 1, no budget spent."""


class SdcGuilty(RuntimeError):
    """Raised by a rank whose replica disagreed with the majority's (silent data corruption):
    its process must go, as after a sticky device error. Classified `OWN_DEVICE`."""


class UpdateRefused(RuntimeError):
    """The fence refused a step's update: the generation was aborted, or one of its NCCL
    communicators reports an error, so the step's gradients may be partial
    (`runtime/generations/fence.py`). Classified `PEER`: the step is redone in the next generation."""


class JobStopped(Exception):
    """Raised by every rank when the job must end and no restart can help (the anomaly
    limit was reached); its message is the one-line report. Classified `STOP`."""


def out_of_memory_text(type_name: str, text: str) -> bool:
    """An allocation that did not fit (device or host), by the error's type name and text."""
    return type_name in ("OutOfMemoryError", "MemoryError") or "out of memory" in (
        f"{type_name}: {text}".lower())


def classify_text(type_name: str, text: str, own_device: int | None = None) -> ErrorClass:
    """`classify` on an error's type name and message, as an agent reads them in an error
    record (pure). An NCCL error about CUDA is this worker's device unless it names
    another `cuda:N` than `own_device`."""
    whole = f"{type_name}: {text}"
    if type_name == JobStopped.__name__:
        return ErrorClass.STOP
    if type_name == SdcGuilty.__name__:
        return ErrorClass.OWN_DEVICE
    if type_name == UpdateRefused.__name__:
        return ErrorClass.PEER
    if out_of_memory_text(type_name, text):
        return ErrorClass.USER
    if type_name == "AcceleratorError" or any(m in whole for m in OWN_DEVICE_MARKERS):
        named = {int(n) for n in re.findall(r"cuda:(\d+)", whole)}
        if "NCCL" in whole and own_device is not None and named and own_device not in named:
            return ErrorClass.PEER  # a peer's device, seen through the communicator
        return ErrorClass.OWN_DEVICE
    if "NCCL" in whole and any(m in whole for m in USER_NCCL_MARKERS):
        return ErrorClass.USER
    if type_name in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError"):
        return ErrorClass.PEER
    return ErrorClass.PEER if any(m in whole for m in PEER_ERROR_MARKERS) else ErrorClass.USER


def classify(exc: BaseException, own_device: int | None = None) -> ErrorClass:
    """Whose fault `exc`, raised in a worker, is. `own_device`: the worker's CUDA device,
    if it has one."""
    if isinstance(exc, JobStopped):
        return ErrorClass.STOP
    if not isinstance(exc, RuntimeError):  # distributed and device errors are RuntimeErrors
        return ErrorClass.USER
    return classify_text(type(exc).__name__, str(exc), own_device)


def current_device() -> int | None:
    """This process's CUDA device, if it has initialised CUDA (never initialises it)."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def is_peer_error(exc: BaseException) -> bool:
    """Did this exception come from the group (a peer died or left), not from the user's
    code or this worker's own device?"""
    return classify(exc, current_device()) == ErrorClass.PEER


def first_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, for events and one-line reports."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:limit]


class UserError(Exception):
    """A mistake the user can fix; printed as one line, never as a traceback."""

    exit_code: ExitCode = ExitCode.USAGE


class ControlPlaneError(UserError):
    """The agents could not form or keep their control plane (store, rendezvous): transient."""

    exit_code = ExitCode.CONTROL_PLANE


class ConfigError(UserError):
    """A configuration that can never work, found at run time (a secret that differs from
    the job's, etcd credentials refused): permanent, exit 2."""


class CheckpointMismatch(UserError):
    """A checkpoint does not fit the model it is loaded into."""
