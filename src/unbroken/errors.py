"""Errors a user can fix, and the exit codes that tell a caller what happened."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of `unbroken run`; documented in the README."""

    SUCCESS = 0
    WORKERS_FAILED = 1  # a fault, and the restart budget was spent
    USAGE = 2  # bad flag, missing script, invalid value
    CONTROL_PLANE = 3  # port in use, rendezvous timed out, control store lost
    INTERRUPTED_SIGINT = 130
    INTERRUPTED_SIGTERM = 143


# What a worker's error says when a peer died or left, not its own code: gloo's connection
# errors, NCCL's, torch's distributed errors. The agent blames such errors on the peer; the
# worker runtime recovers from them in place.
PEER_ERROR_MARKERS = ("gloo", "Connection closed", "Connection reset", "Broken pipe", "NCCL",
                      "DistNetworkError", "DistBackendError", "DistStoreError")


def is_peer_error(exc: BaseException) -> bool:
    """Did this exception come from the group (a peer died or left), not from the user's code?"""
    import torch.distributed as dist  # here: the CLI's usage errors need no torch

    if isinstance(exc, dist.DistError):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return isinstance(exc, RuntimeError) and any(m in text for m in PEER_ERROR_MARKERS)


def first_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line of the message`, for events and one-line reports."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:limit]


class UserError(Exception):
    """A mistake the user can fix; printed as one line, never as a traceback."""

    exit_code: ExitCode = ExitCode.USAGE


class ControlPlaneError(UserError):
    """The agents could not form or keep their control plane (store, rendezvous)."""

    exit_code = ExitCode.CONTROL_PLANE


class CheckpointMismatch(UserError):
    """A checkpoint does not fit the model it is loaded into."""
