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


class UserError(Exception):
    """A mistake the user can fix; printed as one line, never as a traceback."""

    exit_code: ExitCode = ExitCode.USAGE


class ControlPlaneError(UserError):
    """The agents could not form or keep their control plane (store, rendezvous)."""

    exit_code = ExitCode.CONTROL_PLANE


class CheckpointMismatch(UserError):
    """A checkpoint does not fit the model it is loaded into."""
