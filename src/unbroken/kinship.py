"""Process kinship on Linux: who dies with whom, and who reaps whom (prctl).

A worker, a spare and the fork server die with their agent (`die_with`); the agent adopts
every worker the fork server double-forks (`become_subreaper`), so it is their parent as a
torchrun worker's agent is, and gets every exit status. Elsewhere both are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; `parent` is the pid the
    caller expects as its parent (0: none expected, nothing done). If that parent died
    before the request took effect (the race of any fork), this process exits at once."""
    if not parent or not sys.platform.startswith("linux"):
        return
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) and os.getppid() != parent:
        os._exit(1)


def become_subreaper() -> bool:
    """Orphaned descendants (each forked worker, once its intermediate exits) become ours.
    False where the platform cannot."""
    return sys.platform.startswith("linux") and _prctl(_PR_SET_CHILD_SUBREAPER, 1)
